"""Rollout dumps: a step's trajectories on disk, exactly as the trainer saw them, to replay or inspect.

One JSONL file per dumped step, ``RUN_DIR/rollouts/step_000012.jsonl``: one line per trajectory in
the order the trainer received them (``Trajectory.to_dict()`` plus ``step`` and ``advantages``, the
per-token advantages the trainer got; ``null`` for an episode that was not trained on, e.g. a
failed one). ``run.dump_rollouts=N`` dumps every N-th step (0 = never).

``RUN_DIR/samples.jsonl`` is the small always-on cousin for ``miles-agent report``: per step, the
best and worst scored trajectory (plus a failed one, if any), same line format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError
from miles_agent.metrics import read_jsonl
from miles_agent.types import Status, Trajectory

ROLLOUTS_DIR = "rollouts"
SAMPLES_FILE = "samples.jsonl"
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")


@dataclass
class StepDump:
    step: int
    trajectories: list[Trajectory]  # every episode of the step, in trainer order first
    advantages: list[list[float] | None]  # aligned with ``trajectories``; None = not trained on

    def train_batch(self) -> tuple[list[Trajectory], list[list[float]]]:
        """The trajectories and advantages the trainer got, in the same order."""
        pairs = [(t, a) for t, a in zip(self.trajectories, self.advantages) if a is not None]
        return [t for t, _ in pairs], [a for _, a in pairs]


def dump_lines(step: int, trajs: list[Trajectory], trained: list[Trajectory],
               advantages: list[list[float]]) -> list[str]:
    """The trained trajectories in trainer order with their advantages, then the others of ``trajs``."""
    adv = {t.uid: list(a) for t, a in zip(trained, advantages)}
    rest = [t for t in trajs if t.uid not in adv]
    return [json.dumps({"step": step, **t.to_dict(), "advantages": adv.get(t.uid)}) + "\n"
            for t in [*trained, *rest]]


def step_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:06d}.jsonl"


def parse_lines(lines: list[str], where: str) -> StepDump:
    trajs, advs, steps = [], [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            trajs.append(Trajectory.from_dict(d))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{where} line {n} is not a trajectory record ({e}); was it written by "
                            "run.dump_rollouts?") from None
        advs.append(d.get("advantages"))
        steps.add(int(d.get("step", -1)))
    if len(steps) > 1:
        raise UserError(f"{where} mixes steps {sorted(steps)}; a dump file holds one step")
    return StepDump(steps.pop() if steps else -1, trajs, advs)


def read_step(path: Path) -> StepDump:
    return parse_lines(Path(path).read_text().splitlines(), str(path))


def list_steps(folder: Path) -> list[int]:
    """Steps dumped in ``folder`` (a run directory or its ``rollouts/`` folder), ascending."""
    folder = Path(folder)
    if (folder / ROLLOUTS_DIR).is_dir():
        folder = folder / ROLLOUTS_DIR
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder of rollout dumps; train with run.dump_rollouts=1 to write "
                        f"RUN_DIR/{ROLLOUTS_DIR}/step_N.jsonl")
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_FILE.search(p.name)))


def dumps_folder(folder: Path) -> Path:
    folder = Path(folder)
    return folder / ROLLOUTS_DIR if (folder / ROLLOUTS_DIR).is_dir() else folder


def pick_samples(trajs: list[Trajectory], k: int) -> list[Trajectory]:
    """Up to ``k`` trajectories worth reading: the best and worst scored ones first, then a failed one."""
    if k <= 0:
        return []
    scored = sorted((t for t in trajs if t.reward is not None), key=lambda t: -float(t.reward))
    picked: list[Trajectory] = []
    for t in [*scored[:1], *scored[-1:], *[t for t in trajs if t.status is Status.FAILED][:1], *scored[1:-1]]:
        if all(t is not p for p in picked):
            picked.append(t)
    return picked[:k]


class RolloutRecorder:
    """Writes the full dump every ``every`` steps and ``samples`` trajectories per step to samples.jsonl."""

    def __init__(self, run_dir: Path, every: int, samples: int, start_step: int = 0) -> None:
        if every < 0 or samples < 0:
            raise UserError(f"run.dump_rollouts ({every}) and run.log_samples ({samples}) must be >= 0")
        self.run_dir, self.every, self.samples = Path(run_dir), every, samples
        self.samples_path = self.run_dir / SAMPLES_FILE
        if start_step == 0 and (self.run_dir / ROLLOUTS_DIR).is_dir():  # a fresh run in an old folder
            for old in (self.run_dir / ROLLOUTS_DIR).glob("step_*.jsonl"):
                old.unlink()
        if self.samples_path.exists():  # a resumed run redoes the steps after its checkpoint
            kept = [r for r in read_jsonl(self.samples_path) if r.get("step", 0) < start_step]
            self.samples_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def record(self, step: int, trajs: list[Trajectory], trained: list[Trajectory],
               advantages: list[list[float]]) -> Path | None:
        if self.samples:
            picked = pick_samples(trajs, self.samples)
            adv = {t.uid: a for t, a in zip(trained, advantages)}
            with self.samples_path.open("a") as f:
                f.writelines(json.dumps({"step": step, **t.to_dict(), "advantages": adv.get(t.uid)}) + "\n"
                             for t in picked)
        if not self.every or step % self.every:
            return None
        path = step_path(self.run_dir / ROLLOUTS_DIR, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(dump_lines(step, trajs, trained, advantages)))
        tmp.rename(path)  # a reader never sees half a step
        return path


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """Sample records for the report: samples.jsonl, else the first lines of the full dumps."""
    run_dir = Path(run_dir)
    path = run_dir / SAMPLES_FILE
    if path.is_file():
        return read_jsonl(path)
    out = []
    if (run_dir / ROLLOUTS_DIR).is_dir():
        for step in list_steps(run_dir):
            lines = step_path(run_dir / ROLLOUTS_DIR, step).read_text().splitlines()
            out.extend(json.loads(line) for line in lines[:2] if line.strip())
    return out
