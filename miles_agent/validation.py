"""The valid range of every numeric config key, one table checked by `build.check_choices` before any
model loads or rank starts: one line naming key, value, range and fix, never a hang (samples_per_prompt=-1)
or a useless run (run.steps=0). Every core int/float key has an entry (tests/safety/test_validation.py);
a plug-in section may declare its own as a ``ranges`` class attribute ({field: Range})."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from miles_agent.errors import UserError


@dataclasses.dataclass(frozen=True)
class Range:
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False  # low itself excluded (lr > 0)
    high_open: bool = False
    what: str = ""  # what a special value means, for the message
    finite: bool = True  # inf refused (unless the key's default is inf itself)

    def holds(self, v: float) -> bool:  # NaN holds nowhere
        return (v > self.low if self.low_open else v >= self.low) and (v < self.high if self.high_open else v <= self.high)

    def describe(self) -> str:
        lo, hi = f"{'>' if self.low_open else '>='} {self.low:g}", f"{'<' if self.high_open else '<='} {self.high:g}"
        return hi if math.isinf(self.low) else lo if math.isinf(self.high) else f"{lo} and {hi}"


ANY, POS, NONNEG, ONE_UP, UNIT = Range(), Range(0, low_open=True), Range(0), Range(1), Range(0, 1)

RANGES: dict[str, Range] = {
    "rollout.prompts_per_step": ONE_UP, "rollout.prefix_cache_mb": Range(0, what="0 = off"), "rollout.samples_per_prompt": ONE_UP, "rollout.temperature": NONNEG,
    "rollout.top_p": Range(0, 1, low_open=True), "rollout.top_k": Range(-1, what="-1 or 0 = off"),
    "rollout.max_batch_size": ONE_UP, "rollout.concurrency": ONE_UP, "rollout.max_staleness": NONNEG,
    "rollout.max_recycles": NONNEG, "train.lr": POS, "train.lr_warmup_steps": NONNEG,
    "train.lr_decay_steps": NONNEG, "train.min_lr_ratio": UNIT, "train.weight_decay": NONNEG,
    "train.betas": Range(0, 1, high_open=True), "train.adam_eps": POS,
    "train.grad_clip": Range(what="<= 0 = no clipping", finite=False), "train.micro_batch_tokens": ONE_UP,
    "train.mini_batches": ONE_UP, "train.ppo_epochs": ONE_UP, "train.world_size": ONE_UP,
    "train.logits_chunk_tokens": Range(0, what="0 = unchunked"), "algo.gamma": UNIT, "algo.turn_discount": UNIT, "algo.overlong_weight": UNIT, "algo.gae_lambda": UNIT,
    "algo.clip_eps": POS, "algo.clip_eps_high": POS, "algo.dual_clip_c": Range(1, low_open=True),
    "algo.kl_coef": NONNEG, "algo.kl_reward_coef": NONNEG, "algo.entropy_coef": ANY, "algo.critic_lr": POS,
    "algo.value_clip": Range(what="<= 0 = unclipped", finite=False), "algo.mismatch_low": NONNEG, "algo.mismatch_high": POS,
    "algo.mismatch_veto": NONNEG, "algo.dynamic_sampling_max_rounds": ONE_UP, "algo.distill_coef": NONNEG,
    "algo.distill_task_coef": NONNEG, "sft.tool_rate": UNIT, "sft.batch_size": ONE_UP,
    "sft.max_examples": Range(0, what="0 = all"), "env.max_turns": ONE_UP, "env.max_total_tokens": ONE_UP,
    "env.max_new_tokens_per_turn": ONE_UP, "env.max_observation_tokens": ONE_UP, "env.agent_timeout_s": Range(0, low_open=True, finite=False),
    "run.steps": ONE_UP, "run.seed": ANY, "run.checkpoint_every": Range(0, what="0 = only at the end"),
    "run.eval_every": Range(0, what="0 = never"), "run.dump_rollouts": Range(0, what="0 = never"),
    "run.log_samples": NONNEG, "cluster.num_engines": ONE_UP, "cluster.gpus_per_engine": NONNEG,
    "cluster.trainer_gpus": NONNEG, "cluster.cpus_per_actor": NONNEG, "cluster.health_check_interval_s": Range(0, what="0 = no health checks"),
    "cluster.health_check_timeout_s": Range(0, low_open=True, finite=False), "cluster.max_engine_restarts": NONNEG, "cluster.nodes": ONE_UP,
    "cluster.gpus_per_node": ONE_UP, "cluster.gpu_memory_gib": POS, "sync.bucket_mb": ONE_UP,
    "sync.master_port": Range(0, 65535, what="0 = a free port"), "sync.disk_keep": ONE_UP,
}


def numbers(value: Any) -> list[float]:
    """The numbers in a field's value (a tuple field such as betas: each one); [] for anything else."""
    return [float(v) for v in (value if isinstance(value, tuple) else (value,)) if type(v) in (int, float)]


def check_values(cfg: Any) -> None:
    """Every numeric value of every section in its range, and no NaN anywhere; raises UserError."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "sections"}
    for name, section in {**sections, **cfg.sections}.items():
        for f in dataclasses.fields(section):
            key = f"{name}.{f.name}"
            rng = getattr(section, "ranges", {}).get(f.name) or RANGES.get(key, ANY)
            values = numbers(getattr(section, f.name))
            if not all(rng.holds(v) for v in values):
                raise UserError(_message(key, getattr(section, f.name), rng, f.default))
            if any(map(math.isinf, values)) and not any(map(math.isinf, numbers(f.default))) and rng.finite:
                raise UserError(f"{key}={values[0]:g} is not a finite number; {_message(key, 0, rng, f.default).split('; ')[-1]}")
    _check_pairs(cfg)


def _message(key: str, value: Any, rng: Range, default: Any) -> str:
    show = lambda v: f"[{', '.join(f'{x:g}' for x in v)}]" if isinstance(v, tuple) else f"{v:g}"  # noqa: E731
    fix = f"set e.g. {key}={show(default)} (the default)" if numbers(default) and all(
        rng.holds(v) for v in numbers(default)) else f"set {key} in range"
    return f"{key}={show(value)} is out of range: it must be {rng.describe()}{f' ({rng.what})' if rng.what else ''}; {fix}"


def _check_pairs(cfg: Any) -> None:
    if cfg.env.reward_out_of_range not in ("refuse", "clip"):
        raise UserError(f"env.reward_out_of_range={cfg.env.reward_out_of_range!r}: choose refuse or clip")
    if (algo := cfg.algo).mismatch_low > algo.mismatch_high:
        raise UserError(f"algo.mismatch_low={algo.mismatch_low:g} is above algo.mismatch_high="
                        f"{algo.mismatch_high:g}; the trust range is [low, high], so set low <= high")
