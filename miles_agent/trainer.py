"""The trainer contract. Trainers are algorithm-blind: the driver computes per-token advantages, the
trainer computes logprobs, applies the configured loss function (chosen by name) and steps.

Backends live in ``trainers/`` (installed as ``miles_agent.trainers``): ``fsdp2`` (CPU and GPU),
later ``megatron`` (GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from miles_agent.types import Trajectory

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class TrainBatch:
    """Trajectories plus one advantage per response token (aligned with ``Trajectory.loss_mask``).

    ``old_logprobs`` / ``ref_logprobs`` (same alignment), when the driver already computed them for
    its estimator, spare the trainer a second forward; None = the trainer computes what it needs."""

    trajectories: list[Trajectory]
    advantages: list[list[float]]
    old_logprobs: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    # A teacher's logprob per response token: on-policy distillation's loss term (algorithms/distill.py).
    teacher_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        for name in ("advantages", "old_logprobs", "ref_logprobs", "teacher_logprobs"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(self.trajectories) != len(rows):
                raise ValueError(f"{len(self.trajectories)} trajectories but {len(rows)} {name} rows")
            for t, a in zip(self.trajectories, rows):
                if len(a) != t.response_length:
                    raise ValueError(f"trajectory {t.uid}: {len(a)} {name} for {t.response_length} response tokens")

    @property
    def num_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.trajectories)


@runtime_checkable
class Trainer(Protocol):
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Optimizer step(s) over the whole batch (``train.mini_batches`` x ``train.ppo_epochs``, each
        packed into micro-batches); returns metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under their HF names, streamed for weight sync."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer and RNG state, written atomically (to a temp folder, then renamed)."""
        ...

    def load_checkpoint(self, path: Path) -> None: ...

    def save_hf(self, path: Path) -> None:
        """The policy as an HF-format folder (config, safetensors, tokenizer)."""
        ...
