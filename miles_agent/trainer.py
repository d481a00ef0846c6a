"""The trainer contract. Trainers are algorithm-blind: the driver computes per-token advantages, the
trainer computes logprobs, applies the configured loss function (chosen by name) and steps.

Backends live in ``trainers/`` (installed as ``miles_agent.trainers``): ``fsdp2`` (CPU and GPU) and
``megatron`` (GPU, and CPU for tests), both ``trainers/policy_trainer.PolicyTrainer`` subclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
    """Everything the core (``loop``, ``sft``, ``warmstart``, ``replay``, ``algorithms.batch_builder``, the
    weight transports and the Ray trainer actor) calls on a policy trainer. Methods that run collectives
    must be called on every rank. ``trainers/policy_trainer.PolicyTrainer`` implements all of it given
    five backend hooks; ``miles_agent.testing.contracts.TrainerContract`` checks a trainer against it."""

    rank: int
    """This process's rank in the trainer's group (rank 0 writes files and feeds the weight push)."""
    device: torch.device
    """Where the trainer computes; the loop sets it as the current CUDA device of its worker thread."""
    on_micro_batch: Callable[[int, int], None] | None
    """Set by the live view: called with (micro-batches done, total) during ``train_step``."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Optimizer step(s) over the whole batch (``train.mini_batches`` x ``train.ppo_epochs``, each
        packed into micro-batches); returns metrics (``loss``, ``grad_norm``, ``lr``, ``tokens``, ...,
        see docs/metrics.md)."""
        ...

    def compute_logprobs(self, trajectories: Sequence[Trajectory], reference: bool = False) -> list[list[float]]:
        """Per trajectory, the current (``reference``: the frozen initial) policy's logprob of every
        response token at the rollout temperature, 0.0 where the engine did not sample; aligned with
        ``Trajectory.loss_mask``. ``reference`` without a reference model raises ValueError."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under their HF names, streamed for weight sync. A collective:
        iterate it to the end on every rank."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer and RNG state, written atomically (to a temp folder, then renamed)."""
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore what ``save_checkpoint`` wrote: the same weights, optimizer state and step."""
        ...

    def save_hf(self, path: Path) -> None:
        """The policy as an HF-format folder (config, safetensors, tokenizer)."""
        ...

    def close(self) -> None:
        """Release the process group (if the trainer created it) and anything else it holds."""
        ...


@runtime_checkable
class DeviceMemory(Protocol):
    """What the Ray trainer actor reads of an offloadable trainer's ``memory`` (trainers/offload.py)."""

    offloaded: bool

    def resident_bytes(self) -> int:
        """Bytes the trainer's tensors hold on its device now (0 while offloaded)."""
        ...


@runtime_checkable
class OffloadableTrainer(Trainer, Protocol):
    """A trainer that can give its device to colocated engines (``train.offload``, docs/runtime.md)."""

    memory: DeviceMemory

    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state to host memory; ``reload`` before any other call."""
        ...

    def reload(self) -> dict[str, float]:
        """Everything back on the device, bit for bit."""
        ...
