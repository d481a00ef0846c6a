"""Warm starts: RL needs a policy that is not random, so the project makes its own.

An environment that offers ``demonstrator(tokenizer)`` (a scripted `Policy`) gets a warm start by
supervised fine-tuning through the one SFT path (miles_agent/sft.py): the demonstrator plays episodes
through the real harness (so the SFT data is genuine TITO trajectories with loss masks), and the
trainer's ``sft`` loss imitates its turns. The result is an HF folder, shipped with the environment
when it is small, else made once and cached.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_agent import registry
from miles_agent.build import DEFAULT_HARNESS, sandbox_factory
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.environment import Environment, HarnessLimits
from miles_agent.errors import UserError
from miles_agent.sft import demonstrations, sft_steps

log = logging.getLogger(__name__)

WARM_START_VERSION = 3
WARM_START_TRAINER = "fsdp2"  # runs on CPU, so the shipped warm start rebuilds anywhere


def shipped_path(env: Environment, arch: str) -> Path:
    return Path(inspect.getfile(type(env))).parent / "warmstart" / arch


def cache_path(env: Environment, arch: str) -> Path:
    root = Path(os.environ.get("MILES_AGENT_CACHE", "~/.cache/miles-agent")).expanduser()
    return root / "warmstart" / f"{env.name}-{arch}-v{WARM_START_VERSION}"


def ensure_warm_start(env: Environment, arch: str) -> Path:
    """The warm-start folder for ``env``: shipped, cached, or built now (and cached)."""
    for p in (shipped_path(env, arch), cache_path(env, arch)):
        if (p / "config.json").is_file():
            return p
    out = cache_path(env, arch)
    log.warning("building the %s warm start for %s once (cached in %s)", env.name, arch, out)
    build_warm_start(env, arch, out)
    return out


@dataclass(frozen=True)
class SFTStage:
    """``steps`` SFT steps on episodes of the environment's demonstrator at ``tool_rate``."""

    steps: int
    tool_rate: float


# First the skills, then the habits: SFT on the oracle (tool use every time) teaches the tool-call and
# answer formats; a short final stage on the lazy demonstrator (tool use 30% of the time) leaves a
# policy that can use its tool but mostly does not -- which RL then has to fix.
DEFAULT_STAGES = (SFTStage(steps=400, tool_rate=1.0), SFTStage(steps=60, tool_rate=0.3))


def build_warm_start(env: Environment, arch: str, out: Path, *, stages: tuple[SFTStage, ...] | None = None,
                     batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                     progress: bool = True) -> dict[str, float]:
    """SFT a fresh tiny model on the environment's demonstrator, stage by stage, one cosine schedule
    over all of them; returns the final SFT metrics. Uses the env's "sft" split, never its RL tasks."""
    import torch

    from miles_agent.models.builder import build_tiny

    if not hasattr(env, "demonstrator"):
        raise UserError(f"environment {env.name!r} ships no warm start (no demonstrator); "
                        "pass --hf-checkpoint DIR with a model to start from")
    # An env may set its own, as SFTStages or (steps, tool_rate) pairs (an env module need not import this one).
    stages = tuple(s if isinstance(s, SFTStage) else SFTStage(*s)
                   for s in stages or getattr(env, "warm_start_stages", DEFAULT_STAGES))
    model, tokenizer = build_tiny(arch, seed=seed)
    total = sum(stage.steps for stage in stages)
    schedule = TrainConfig(lr=lr, lr_schedule="cosine", lr_warmup_steps=20, lr_decay_steps=total,
                           min_lr_ratio=0.05, grad_clip=1.0, micro_batch_tokens=16384)
    trainer = registry.load("trainers", WARM_START_TRAINER)(model, tokenizer, schedule, AlgoConfig(loss="sft"))
    rng = random.Random(seed)
    metrics: dict[str, float] = {}
    bar = _bar(total, progress)
    for index, stage in enumerate(stages):
        def on_step(m: dict[str, float], index: int = index) -> None:
            bar.set_postfix(stage=index, loss=f"{m['loss']:.3f}")
            bar.update()

        demos = _demonstrations(env, tokenizer, stage, seed + index)
        metrics = sft_steps(trainer, demos, stage.steps, batch_size, rng, on_step)
    bar.close()
    with torch.no_grad():
        trainer.save_hf(out)
    trainer.close()
    return metrics


def _demonstrations(env: Environment, tokenizer: Any, stage: SFTStage, seed: int) -> list[Any]:
    """The demonstrator's episodes on the env's "sft" split, played through the env's own harness (TITO
    data) -- in its sandbox when its tasks need one (the backend it was built with, else the local one)."""
    name = getattr(env, "default_harness", DEFAULT_HARNESS)
    harness = registry.load("harnesses", name)(tokenizer, HarnessLimits(), SamplingParams(max_new_tokens=128))
    make_sandbox = None
    if getattr(env, "needs_sandbox", False):
        make_sandbox = sandbox_factory(getattr(env, "sandbox", "local"), getattr(env, "sandbox_options", None))
    return demonstrations(env, harness, tokenizer, split="sft", tool_rate=stage.tool_rate, seed=seed,
                          make_sandbox=make_sandbox)


def _bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="warm start (SFT)", disable=not enabled, leave=False)
