"""Replay training from rollout dumps: the trainer alone, fed the exact batches a run trained on.

Debugging a training problem (a loss spike, a NaN, a config change to try) should not need the
rollouts re-run. ``miles-agent replay RUN_DIR`` rebuilds the run's policy and trainer from its
``config.json`` (with optional ``section.key=value`` overrides), starts from the run's initial
weights (or a checkpoint at the first replayed step) and calls ``train_step`` on each dumped step
in order, then compares the train metrics with the original ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from miles_agent.dumps import dumps_folder, list_steps, read_step, step_path
from miles_agent.errors import UserError
from miles_agent.metrics import read_jsonl


def _flatten(cfg: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, keys in cfg.items() for key, value in keys.items()}


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> Any:
    from miles_agent.config import load_config

    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{run_dir} has no config.json; replay needs the run directory the dumps came from")
    # The run's values as overrides (JSON is YAML), then the user's, which win.
    saved = [f"{key}={json.dumps(value)}" for key, value in _flatten(json.loads(path.read_text())).items()]
    return load_config(None, saved + list(overrides or []))


def _start_weights(run_dir: Path, first_step: int) -> Path | None:
    """None = the run's initial weights (step 0); else the checkpoint saved at ``first_step``."""
    if first_step == 0:
        return None
    ckpt = Path(run_dir) / "checkpoints" / f"step_{first_step}" / "trainer"
    if not ckpt.is_dir():
        raise UserError(f"replaying from step {first_step} needs the weights the run had then: no checkpoint "
                        f"{ckpt}; replay from step 0 (--from 0) or train with run.checkpoint_every so one exists")
    return ckpt


def replay(run_dir: Path, rollouts: Path | None = None, first: int | None = None, last: int | None = None,
           overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """Train on dumped steps ``first..last`` (default: every consecutive dumped step from the first);
    returns one record per step: ``{"step", "train/...": replayed, "original/train/...": logged}``."""
    import torch

    from miles_agent.build import build_env
    from miles_agent.components import build_trainer
    from miles_agent.models.loading import load_policy
    from miles_agent.trainer import TrainBatch

    run_dir = Path(run_dir)
    folder = dumps_folder(rollouts or run_dir)
    steps = list_steps(folder)
    if not steps:
        raise UserError(f"no rollout dumps in {folder}; train with run.dump_rollouts=1 to write them")
    first = steps[0] if first is None else first
    wanted = [s for s in steps if s >= first and (last is None or s <= last)]
    if not wanted or wanted[0] != first:
        raise UserError(f"step {first} was not dumped in {folder} (dumped: {steps[:10]}...)")
    gaps = [b for a, b in zip(wanted, wanted[1:]) if b != a + 1]
    if gaps:  # training on step N+2 without step N+1 would start from the wrong weights
        wanted = wanted[: wanted.index(gaps[0])]
    cfg = load_run_config(run_dir, overrides)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)  # the same initial weights as the run (tiny models draw from it)
    model, tokenizer = load_policy(cfg, build_env(cfg))
    trainer = build_trainer(cfg, model, tokenizer)
    try:
        ckpt = _start_weights(run_dir, first)
        if ckpt is not None:
            trainer.load_checkpoint(ckpt)
        original = {}
        if (run_dir / "metrics.jsonl").is_file():
            original = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
        out = []
        for step in wanted:
            trajs, advantages = read_step(step_path(folder, step)).train_batch()
            metrics = trainer.train_step(TrainBatch(trajs, advantages))
            record: dict[str, Any] = {"step": step, **{f"train/{k}": v for k, v in metrics.items()}}
            for key, value in original.get(step, {}).items():
                if key.startswith("train/"):
                    record[f"original/{key}"] = value
            out.append(record)
        return out
    finally:
        if hasattr(trainer, "close"):
            trainer.close()


def compare_lines(records: list[dict[str, Any]], keys: tuple[str, ...] = ("loss", "grad_norm", "entropy",
                                                                           "logprob_mismatch_mean")) -> list[str]:
    """One line per step: replayed vs original for the headline train metrics."""
    lines = []
    for r in records:
        cells = []
        for k in keys:
            new, old = r.get(f"train/{k}"), r.get(f"original/train/{k}")
            if new is None:
                continue
            if old is None:
                cells.append(f"{k} {new:.6g}")
            else:
                diff = abs(new - old) if math.isfinite(new) and math.isfinite(old) else float("nan")
                cells.append(f"{k} {new:.6g} (run {old:.6g}, |Δ| {diff:.1e})")
        lines.append(f"step {r['step']:>4} | " + " | ".join(cells))
    return lines
