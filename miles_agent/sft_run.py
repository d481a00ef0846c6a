"""The ``algo.loss: sft`` run: its data, its trainer, ``run.steps`` steps of the one SFT path (sft.py)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_agent.config import Config
from miles_agent.environment import Environment
from miles_agent.errors import UserError
from miles_agent.sft import demonstrations, read_trajectories, sft_steps
from miles_agent.types import Trajectory


def load_data(cfg: Config, env: Environment, tokenizer: Any, vocab_size: int) -> list[Trajectory]:
    """The trajectories ``cfg.sft`` names (see the module docstring)."""
    if cfg.sft.data == "demonstrator":
        from miles_agent.build import build_harness, env_sandboxes

        return demonstrations(env, build_harness(cfg, env, tokenizer), tokenizer, split=cfg.sft.split,
                              tool_rate=cfg.sft.tool_rate, seed=cfg.run.seed, limit=cfg.sft.max_examples,
                              make_sandbox=env_sandboxes(cfg, env))
    return read_trajectories(cfg.sft.data, vocab_size, limit=cfg.sft.max_examples)


class SFTRun:
    """One ``algo.loss: sft`` run: data, trainer, ``run.steps`` steps, ``metrics.jsonl`` (and the
    ``run.sinks``) and ``final/``."""

    def __init__(self, cfg: Config) -> None:
        import torch

        from miles_agent.build import build_env, check_choices
        from miles_agent.components import build_trainer
        from miles_agent.models.loading import load_policy
        from miles_agent.sinks import build_sinks

        check_choices(cfg)
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
