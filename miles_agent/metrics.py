"""Per-step metrics: computed from trajectories, appended to ``metrics.jsonl``, summarized in one line."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError
from miles_agent.types import Status, Trajectory


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSONL file's records; a torn last line (a kill mid-write) is dropped with a warning, a bad one before it refused."""
    lines = Path(path).read_text(errors="replace").splitlines() if Path(path).is_file() else []
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out += [json.loads(line)] if line.strip() else []
        except ValueError:
            if any(rest.strip() for rest in lines[n:]):
                raise UserError(f"{path} line {n} is not JSON; was the file edited by hand? Remove it to go on") from None
            logging.getLogger(__name__).warning("%s: its last line (%d) is torn, as a crash mid-write leaves it; reading the %d "
                        "whole records before it", path, n, len(out))
    return out


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    scored = [t for t in trajs if t.status in (Status.COMPLETED, Status.TRUNCATED)]
    rewards = [float(t.reward) for t in scored]
    out: dict[str, float] = {
        "episodes": float(len(trajs)),
        "failed": float(sum(t.status is Status.FAILED for t in trajs)),
        "truncated_frac": _mean([float(t.status is Status.TRUNCATED) for t in scored]),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "response_len": _mean([float(t.response_length) for t in scored]),
        "sampled_tokens": float(sum(sum(t.loss_mask) for t in scored)),
        "turns": _mean([float(t.num_turns) for t in scored]),
    }
    for key in sorted({k for t in scored for k in t.reward_parts}):
        out[f"reward/{key}"] = _mean([t.reward_parts.get(key, 0.0) for t in scored])
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class MetricsLog:
    """Appends one JSON object per step; a resumed run keeps appending to the same file."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)


def summary_line(r: dict[str, Any]) -> str:
    def f(key: str, fmt: str = ".3f") -> str:
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    return (f"step {r['step']:>4} | reward {f('reward_mean')} ± {f('reward_std')} | len {f('response_len', '.0f')}"
            f" | loss {f('train/loss', '.4f')} | kl {f('train/kl', '.4f')} | gnorm {f('train/grad_norm', '.3f')}"
            f" | rollout {f('time/rollout', '.1f')}s train {f('time/train', '.1f')}s sync {f('time/sync', '.2f')}s"
            + "".join(f" | {name} {r[key]:.0f}" for key, name in _FAILURES if r.get(key)))


# Shown in the summary line only when non-zero in that step.
_FAILURES = (("failures/failed_episodes", "failed"), ("failures/episode_retries", "retries"),
             ("failures/engine_failed_steps", "engine errors"))
