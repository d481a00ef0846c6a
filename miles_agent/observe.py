"""The per-step numbers the loop does not compute inline: staleness, length spread, and what failed.

Failure counters live in long-lived objects (the episode runner, the engines) and only grow;
``StepObserver`` snapshots them so each step record carries that step's share. The names follow
docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from miles_agent.types import SpanKind, Status, Trajectory

# engine stats counter -> record key (engines without a counter simply report nothing)
ENGINE_COUNTERS = {"failed_steps": "failures/engine_failed_steps", "retractions": "failures/engine_retractions"}
RUNNER_COUNTERS = {"retries": "failures/episode_retries", "sandbox_errors": "failures/sandbox_errors",
                   "aborts": "failures/generation_aborts"}


def staleness(traj: Trajectory, trainer_version: int) -> int | None:
    """How many weight versions behind the trainer the oldest sampled span is (0 = on-policy)."""
    versions = [s.weight_version for s in traj.spans if s.kind is SpanKind.MODEL and s.weight_version is not None]
    return trainer_version - min(versions) if versions else None


def staleness_metrics(trajs: list[Trajectory], trainer_version: int) -> dict[str, float]:
    values = [v for v in (staleness(t, trainer_version) for t in trajs) if v is not None]
    if not values:
        return {}
    out = {"staleness/mean": sum(values) / len(values), "staleness/max": float(max(values))}
    for lag, count in sorted(Counter(values).items()):
        out[f"staleness/hist/{lag}"] = float(count)
    return out


def length_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    scored = [t for t in trajs if t.status in (Status.COMPLETED, Status.TRUNCATED)]
    if not scored:
        return {}
    lengths = [t.response_length for t in scored]
    return {"response_len_min": float(min(lengths)), "response_len_max": float(max(lengths)),
            "prompt_len": sum(len(t.prompt_ids) for t in scored) / len(scored)}


class StepObserver:
    """Turns the run's cumulative counters into per-step deltas."""

    def __init__(self, runner: Any, engines: list[Any]) -> None:
        self.runner, self.engines = runner, engines
        self._last = self._counters()

    def _counters(self) -> dict[str, float]:
        out = {key: float(getattr(self.runner.stats, attr, 0)) for attr, key in RUNNER_COUNTERS.items()}
        for attr, key in ENGINE_COUNTERS.items():
            out[key] = float(sum(getattr(e, "stats", {}).get(attr, 0) for e in self.engines))
        return out

    def rollout_record(self, trajs: list[Trajectory], trainer_version: int) -> dict[str, float]:
        now = self._counters()
        record = {key: now[key] - self._last.get(key, 0.0) for key in now}
        self._last = now
        record["failures/failed_episodes"] = float(sum(t.status is Status.FAILED for t in trajs))
        record.update(length_metrics(trajs))
        record.update(staleness_metrics(trajs, trainer_version))
        return record
