"""Learning-rate schedules as pure functions of the optimizer step, so a resumed run needs no extra state."""

from __future__ import annotations

import math

from miles_agent.config import TrainConfig
from miles_agent.errors import UserError

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over ``lr_warmup_steps``, then constant or a decay to ``min_lr_ratio * lr`` at
    ``lr_decay_steps``."""
    if cfg.lr_schedule not in SCHEDULES:
        raise UserError(f"unknown train.lr_schedule {cfg.lr_schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if cfg.lr_warmup_steps > 0 and step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_decay_steps <= cfg.lr_warmup_steps:
        raise UserError(f"train.lr_schedule={cfg.lr_schedule} needs train.lr_decay_steps > lr_warmup_steps "
                        f"(got {cfg.lr_decay_steps}); set it to the number of optimizer steps")
    progress = min(1.0, (step - cfg.lr_warmup_steps) / (cfg.lr_decay_steps - cfg.lr_warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)
