"""Supervised fine-tuning on TITO trajectories: the one SFT path, used by ``algo.loss: sft`` runs
(``miles-agent train --recipe tiny-sft``, driven by miles_agent/sft_run.py) and by the warm start
(miles_agent/warmstart.py).

The data are whole trajectories, each rendered once by a harness (multi-turn, tool turns included),
and what trains is exactly their ``loss_mask``: the model's own turns, never the prompt or the tool
output, and never a re-render of one message at a time. Two sources:

* ``sft.data: demonstrator`` -- the environment's scripted demonstrator plays its ``sft`` split
  through the real harness, so the data are genuine engine-shaped trajectories;
* ``sft.data: PATH.jsonl`` -- one ``Trajectory.to_dict()`` object per line (e.g. kept episodes of an
  earlier run, written by :func:`write_trajectories`).

Rewards are ignored: every loss-masked token is imitated (``algo.loss=sft``, the masked NLL).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from miles_agent.environment import Environment, Harness, split_tasks
from miles_agent.errors import UserError
from miles_agent.types import Status, Trajectory, TrajectoryError

log = logging.getLogger(__name__)

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


# -- data ------------------------------------------------------------------------------------------

def demonstrations(env: Environment, harness: Harness, tokenizer: Any, *, split: str = "sft",
                   tool_rate: float = 1.0, seed: int = 0, limit: int = 0, concurrency: int = 256,
                   make_sandbox: Callable[[], Any] | None = None) -> list[Trajectory]:
    """The env's demonstrator playing the tasks of ``split`` (the first ``limit``; 0 = all) once
    each through ``harness`` (TITO data), in sandboxes from ``make_sandbox`` when the env needs them."""
    from miles_agent.rollout.episodes import EpisodeRunner, collect

    if not hasattr(env, "demonstrator"):
        raise UserError(f"environment {env.name!r} has no demonstrator to make SFT data; set sft.data to a "
                        "JSONL file of trajectories (one Trajectory.to_dict() per line)")
    tasks = split_tasks(env, split, "sft.split")[:limit or None]
    policy = env.demonstrator(tokenizer, tool_rate=tool_rate, seed=seed)
    trajs = asyncio.run(collect(EpisodeRunner(env, harness, make_sandbox=make_sandbox), tasks, 1, policy, concurrency=concurrency))
    if trajs and not (kept := [t for t in trajs if t.status in TRAINABLE and any(t.loss_mask)]):
        why = sorted({str(t.metadata.get("error") or t.status) for t in trajs})
        raise UserError(f"environment {env.name!r}: none of its demonstrator's {len(trajs)} episodes can be trained on "
                        f"({'; '.join(why[:2])}); fix the environment, or set sft.data to a file of trajectories")
    return kept if trajs else []


def write_trajectories(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    """One ``Trajectory.to_dict()`` per line: the file format ``sft.data`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict()) + "\n")
    return path


def read_trajectories(path: str | Path, vocab_size: int | None = None, limit: int = 0) -> list[Trajectory]:
    """Trainable trajectories from a JSONL file (the first ``limit``; 0 = all); a bad line is a UserError
    naming the line and the fix.

    Lines whose status is ``failed``/``aborted`` or that train no token are skipped (and counted in a
    warning): they carry nothing to imitate. A missing reward is allowed, since SFT ignores rewards.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sft.data: {path} does not exist; point it at a JSONL file of trajectories "
                        "(one Trajectory.to_dict() per line) or set sft.data=demonstrator")
    out, skipped = [], 0
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            t = _parse_line(line, f"{path} line {number}", vocab_size)
            if t.status in TRAINABLE and any(t.loss_mask):
                out.append(t)
                if len(out) == limit:
                    break
            else:
                skipped += 1
    if skipped:
        log.warning("sft.data %s: skipped %d trajectories that train no token (failed, aborted or fully "
                    "masked)", path, skipped)
    if not out:
        raise UserError(f"sft.data: {path} holds no trainable trajectory (none completed or truncated with a "
                        "loss-masked token); write trajectories with Trajectory.to_dict(), one per line")
    return out


def _parse_line(line: str, where: str, vocab_size: int | None) -> Trajectory:
    fix = "each line must be one Trajectory.to_dict() JSON object (see miles_agent.sft.write_trajectories)"
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
    if not isinstance(d, dict):
        raise UserError(f"{where}: a {type(d).__name__}, not a trajectory object; {fix}")
    try:
        t = Trajectory.from_dict(d)
    except KeyError as e:
        raise UserError(f"{where}: not a trajectory, key {e.args[0]!r} is missing; {fix}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: not a trajectory ({e}); {fix}") from None
    if t.reward is None and t.status in TRAINABLE:
        t.reward = 0.0  # SFT never reads rewards; datasets converted from chats have none
    try:
        t.validate()
    except TrajectoryError as e:
        raise UserError(f"{where}: invalid trajectory: {e}; fix or drop the line (loss_mask must cover the "
                        "response and be 1 only inside model spans)") from None
    if vocab_size is not None:
        bad = [x for x in t.tokens if not 0 <= x < vocab_size]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} is outside the model's vocabulary of {vocab_size}; "
                            "the data were tokenized for another model -- use that model's tokenizer")
    return t


# -- training --------------------------------------------------------------------------------------

def sft_steps(trainer: Any, data: Sequence[Trajectory], steps: int, batch_size: int, rng: random.Random,
              on_step: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """``steps`` optimizer steps, each on ``batch_size`` trajectories drawn without replacement;
    returns the last step's metrics. The trainer must have been built with ``algo.loss=sft``."""
    from miles_agent.trainer import TrainBatch

    if not data:
        raise UserError("SFT has no trajectory to train on")
    metrics: dict[str, float] = {}
    for _ in range(steps):
        batch = rng.sample(list(data), min(batch_size, len(data)))
        metrics = trainer.train_step(TrainBatch(batch, [[0.0] * t.response_length for t in batch]))
        if on_step is not None:
            on_step(metrics)
    return metrics
