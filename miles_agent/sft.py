"""Supervised fine-tuning on TITO trajectories: the one SFT path, used by ``algo.loss: sft`` runs
(``miles-agent train --recipe tiny-sft``) and by the warm start (miles_agent/warmstart.py).

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
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from miles_agent.config import Config
from miles_agent.environment import Environment, Harness
from miles_agent.errors import UserError
from miles_agent.types import Status, Trajectory, TrajectoryError

log = logging.getLogger(__name__)

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


# -- data ------------------------------------------------------------------------------------------

def demonstrations(env: Environment, harness: Harness, tokenizer: Any, *, split: str = "sft",
                   tool_rate: float = 1.0, seed: int = 0, limit: int = 0, concurrency: int = 256
                   ) -> list[Trajectory]:
    """The env's demonstrator playing the tasks of ``split`` (the first ``limit``; 0 = all) once
    each through ``harness`` (TITO data)."""
    from miles_agent.rollout.episodes import EpisodeRunner, collect

    if not hasattr(env, "demonstrator"):
        raise UserError(f"environment {env.name!r} has no demonstrator to make SFT data; set sft.data to a "
                        "JSONL file of trajectories (one Trajectory.to_dict() per line)")
    try:
        tasks = env.tasks(split)[:limit or None]
    except ValueError as e:
        raise UserError(f"sft.split={split!r}: {e}") from None
    policy = env.demonstrator(tokenizer, tool_rate=tool_rate, seed=seed)
    trajs = asyncio.run(collect(EpisodeRunner(env, harness), tasks, 1, policy, concurrency=concurrency))
    return [t for t in trajs if t.status in TRAINABLE and any(t.loss_mask)]


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


def load_data(cfg: Config, env: Environment, tokenizer: Any, vocab_size: int) -> list[Trajectory]:
    """The trajectories ``cfg.sft`` names (see the module docstring)."""
    if cfg.sft.data == "demonstrator":
        from miles_agent.loop import build_harness

        return demonstrations(env, build_harness(cfg, env, tokenizer), tokenizer, split=cfg.sft.split,
                              tool_rate=cfg.sft.tool_rate, seed=cfg.run.seed, limit=cfg.sft.max_examples)
    return read_trajectories(cfg.sft.data, vocab_size, limit=cfg.sft.max_examples)


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


class SFTRun:
    """One ``algo.loss: sft`` run: data, trainer, ``run.steps`` steps, ``metrics.jsonl`` (and the
    ``run.sinks``) and ``final/``."""

    def __init__(self, cfg: Config) -> None:
        import torch

        from miles_agent.components import build_trainer
        from miles_agent.loop import build_env, check_device
        from miles_agent.models.loading import load_policy
        from miles_agent.sinks import build_sinks

        check_device(cfg.model.device)
        if cfg.sft.batch_size < 1 or cfg.sft.max_examples < 0:
            raise UserError(f"sft.batch_size must be >= 1 and sft.max_examples >= 0 (0 = all), got "
                            f"{cfg.sft.batch_size} and {cfg.sft.max_examples}")
        self.cfg, self.step = cfg, 0
        self.engines: list[Any] = []  # no rollout engine: what the live view reads finds nothing to count
        self.run_dir = Path(cfg.run.run_dir)
        torch.manual_seed(cfg.run.seed)
        env = build_env(cfg)
        model, tokenizer = load_policy(cfg, env)
        self.data = load_data(cfg, env, tokenizer, int(model.config.vocab_size))
        self.trainer = build_trainer(cfg, model, tokenizer)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        self.metrics = build_sinks(self.run_dir, cfg.run.sinks, cfg.to_dict(), cfg.run.wandb_project)
        self.metrics.path.unlink(missing_ok=True)

    def train(self, progress: Any = None) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        rng = random.Random(self.cfg.run.seed)
        last = time.perf_counter()

        def on_step(metrics: dict[str, float]) -> None:
            nonlocal last
            now = time.perf_counter()
            record = {"step": self.step, "sft/examples": float(len(self.data)),
                      **{f"train/{k}": v for k, v in metrics.items()}, "time/train": now - last}
            last = now
            self.step += 1
            self.metrics.write(record)
            records.append(record)
            if progress is not None:
                progress.step_done(record, summary(record))

        if progress is not None:
            progress.phase("train")
        sft_steps(self.trainer, self.data, self.cfg.run.steps, self.cfg.sft.batch_size, rng, on_step)
        self.trainer.save_hf(self.run_dir / "final")
        return records


def summary(r: dict[str, Any]) -> str:
    return (f"step {r['step']:>4} | sft loss {r['train/loss']:.4f} | tokens {r['train/tokens']:.0f} | "
            f"lr {r['train/lr']:.2e} | gnorm {r['train/grad_norm']:.3f} | train {r['time/train']:.1f}s")


def train_sft(cfg: Config, resume: bool = False, progress: Callable[[Any], Any] | None = None
              ) -> list[dict[str, Any]]:
    """Build an SFT run and train it; ``progress(run)`` makes the live view (as in ``loop.train``)."""
    if resume:
        raise UserError("--resume is for RL runs; an SFT run is short -- start it again without --resume")
    run = SFTRun(cfg)
    view = progress(run) if progress else None
    try:
        return run.train(view)
    finally:
        if hasattr(run.trainer, "close"):
            run.trainer.close()
        run.metrics.close()
        if view is not None:
            view.close()
