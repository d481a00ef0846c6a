"""The policy step every trainer backend shares; a backend implements only the hooks below.

``PolicyTrainer.train_step`` is the one step of the project: mini-batch planning (``minibatch``), old
and reference logprobs computed once before the first update, per-micro-batch loss (``step_loss``),
gradient accumulation, clipping and the optimizer step (``clip_and_step``), and the metric summary.
FSDP2 (``fsdp2.py``) and Megatron (``megatron/trainer.py``) differ only in how they shard the model,
compute a micro-batch's logprobs and complete gradients across ranks, so those are the hooks:

- ``_forward_logprobs(model, mb, entropy, entropy_grad)`` -- logprob of each grid target (and entropy);
- ``_backward(loss)`` -- backward of a micro-batch's loss share, scaled as the backend reduces gradients;
- ``_reduce_grads()`` -- complete gradients the backward left partial (no-op where backward did it);
- ``_grad_norm()`` -- the global gradient norm over every shard (the all-reduce of the shards' norms);
- ``_dp_group()`` -- the process group over which metric shares are summed (data-parallel ranks).

Overridable defaults: ``_build_micro_batches`` (extra per-micro-batch inputs, e.g. routing replay),
``_no_grad_logprobs`` and ``_backward_micro_batches`` (pipeline schedules), ``_sum_metric_shares``,
``_optimized_params`` (what AdamW steps), ``_optimizer_step``, ``_packs_sequences`` (token budget of packed
micro-batches). A backend's ``__init__`` calls ``super().__init__`` first (options are checked
before any weight moves), sets ``model``, ``ref_model``, ``rank``, ``dp_rank``, ``dp_size`` and
``device``, then calls ``_init_optimizer``; it still owns the weights' way out (``named_weights``,
``save_hf``, checkpoints) and ``close``. ``tests/contracts/test_trainer_contract.py`` has a complete
single-process backend in about 50 lines.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from miles_agent.algorithms import mismatch
from miles_agent.algorithms.losses import loss_options, validate_options
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.batching import MicroBatch, build_micro_batch, pack_micro_batches, rank_plan
from miles_agent.trainers.lr_schedule import lr_at
from miles_agent.trainers.minibatch import normalizers, split_mini_batches, step_metrics, to_grid
from miles_agent.trainers.offload import DeviceOffload
from miles_agent.trainers.step_loss import micro_batch_loss
from miles_agent.types import Trajectory


def clip_and_step(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], total_norm: Tensor,
                  grad_clip: float, lr: float | None = None) -> float:
    """Clip ``params``' gradients to ``grad_clip`` (<= 0: measure only) given their global norm, set
    ``lr`` (None: leave it) and step; a non-finite norm skips the step. Returns the norm. One function
    for the policy trainers and the critic, so every backend clips the same way."""
    grad_norm = float(total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm)
    if math.isfinite(grad_norm):
        max_norm = grad_clip if grad_clip > 0 else math.inf
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total_norm)
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def local_grad_norm(params: Sequence[nn.Parameter]) -> Tensor:
    """The L2 norm of ``params``' gradients; with FSDP2's DTensor gradients it is already global."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def check_step_options(train: TrainConfig, algo: AlgoConfig, temperature: float) -> None:
    """The options every backend refuses the same way, before any weight is built."""
    validate_options(algo)
    mismatch.check_options(algo)
    if train.mini_batches < 1 or train.ppo_epochs < 1:
        raise UserError(f"train.mini_batches and train.ppo_epochs must be >= 1 (got {train.mini_batches}, "
                        f"{train.ppo_epochs})")
    if not temperature > 0:
        raise UserError(f"temperature must be > 0 (got {temperature}); logits are divided by it")


@dataclass
class OptimizerStep:
    """One optimizer step's data on this data-parallel rank: its micro-batches, their old and reference
    logprobs (None: the rollout's / no reference), and the step's global loss normalizers."""

    micro_batches: list[MicroBatch]
    olds: list[Tensor | None]
    refs: list[Tensor | None]
    norm: dict


class PolicyTrainer(ABC):
    """Algorithm-blind policy trainer (``miles_agent.trainer.Trainer``) minus the backend hooks."""

    model: nn.Module
    ref_model: nn.Module | None
    rank: int
    optimizer: torch.optim.Optimizer
    device: torch.device
    dp_rank: int
    dp_size: int

    def __init__(self, tokenizer: Any, train: TrainConfig, algo: AlgoConfig, temperature: float) -> None:
        check_step_options(train, algo, temperature)
        self.train_cfg, self.algo, self.temperature = train, algo, float(temperature)
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.step = 0
        self.on_micro_batch: Callable[[int, int], None] | None = None  # (done, total): the live view's hook
        self._loss_opts = loss_options(algo)

    def _init_optimizer(self) -> None:
        """AdamW over ``model``, the schedule checked (a bad one fails here, not at the first step), and
        the colocation offload of both models and the optimizer state (``offload``)."""
        t = self.train_cfg
        # foreach: torch picks the per-tensor loop for DTensor parameters (FSDP2), a dozen dispatches per
        # parameter (14 ms against 4 ms a step on the tiny model); the update is bitwise the same
        self.optimizer = torch.optim.AdamW(self._optimized_params(), lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps,
                                           weight_decay=t.weight_decay, foreach=True)
        lr_at(t, 0)
        self.memory = DeviceOffload(lambda: (self.model, self.ref_model), self.optimizer, self.device)

    # -- backend hooks ------------------------------------------------------------------------------
    @abstractmethod
    def _forward_logprobs(self, model: nn.Module, mb: MicroBatch, entropy: bool = False,
                          entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logprob of each of ``mb``'s grid targets under ``model`` at ``temperature`` (the engine's
        convention), plus the distribution's entropy when asked (with gradient only if ``entropy_grad``)."""

    @abstractmethod
    def _backward(self, loss: Tensor) -> None:
        """Backward of this rank's share of the step's loss, scaled for how the backend reduces gradients."""

    @abstractmethod
    def _reduce_grads(self) -> None:
        """Complete the gradients across ranks before clipping (a no-op where backward already did)."""

    @abstractmethod
    def _grad_norm(self) -> Tensor:
        """The global L2 gradient norm over every rank's shard, replicated weights counted once."""

    @abstractmethod
    def _dp_group(self) -> Any:
        """The process group whose ranks hold different data (metric shares are summed over it)."""

    # -- the weights' way out and in (sharding-specific; see miles_agent.trainer.Trainer) ----------------
    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None: ...

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None: ...

    @abstractmethod
    def save_hf(self, path: Path) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    # -- overridable defaults -----------------------------------------------------------------------
    def _build_micro_batches(self, trajectories: Sequence[Trajectory], plan: list[list[int]],
                             advantages: Sequence[Sequence[float]] | None,
                             teacher: Sequence[Sequence[float]] | None = None) -> list[MicroBatch]:
        return [build_micro_batch(trajectories, idx, advantages, self.pad_id, teacher).to(self.device)
                for idx in plan]

    @torch.no_grad()
    def _no_grad_logprobs(self, model: nn.Module, mbs: Sequence[MicroBatch]) -> list[Tensor]:
        """Every micro-batch's logprobs under ``model``, on every rank."""
        model.eval()
        return [self._forward_logprobs(model, mb)[0] for mb in mbs]

    def _backward_micro_batches(self, step: OptimizerStep, measure: bool) -> Iterator[dict[str, Tensor]]:
        """Forward and backward of one optimizer step's micro-batches, yielding their metric shares."""
        entropy_grad = self.algo.entropy_coef != 0
        for mb, old, ref in zip(step.micro_batches, step.olds, step.refs):
            logp, entropy = self._forward_logprobs(self.model, mb, entropy=True, entropy_grad=entropy_grad)
            loss, metrics = micro_batch_loss(self.algo, self._loss_opts, logp, entropy, mb, old, ref, step.norm,
                                             measure)
            self._backward(loss)
            yield metrics

    def _packs_sequences(self) -> bool:
        """Whether text micro-batches run packed (``batching.pack``): their token budget then counts real
        tokens, not ``rows * longest``."""
        return False

    def _optimized_params(self) -> list[nn.Parameter]:
        """The parameters AdamW steps (Megatron's fp32 main copies under mixed precision)."""
        return list(self.model.parameters())

    def _optimizer_step(self) -> float:
        """Clip and step at the schedule's learning rate; returns the gradient norm."""
        self._reduce_grads()
        grad_norm = clip_and_step(self.optimizer, self._optimized_params(), self._grad_norm(),
                                  self.train_cfg.grad_clip, lr_at(self.train_cfg, self.step))
        self.step += 1
        return grad_norm

    def _sum_metric_shares(self, sums: dict[str, Tensor]) -> tuple[dict[str, float], float]:
        """The metric shares summed over data-parallel ranks (their max for ``mismatch/abs_max``)."""
        mx = sums.pop("mismatch/abs_max", torch.zeros((), device=self.device))
        names = sorted(sums)
        values: dict[str, float] = {}
        if names:
            stacked = torch.stack([torch.as_tensor(sums[k], device=self.device).float() for k in names])
            if self.dp_size > 1:
                dist.all_reduce(stacked, group=self._dp_group())
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self._dp_group())
            values = dict(zip(names, stacked.tolist()))
        return values, float(mx)

    # -- logprobs -----------------------------------------------------------------------------------
    def compute_logprobs(self, trajectories: Sequence[Trajectory], reference: bool = False) -> list[list[float]]:
        """Current-policy (or, with ``reference``, reference-policy) logprob per response position
        (0.0 where the model did not sample). Every rank computes all trajectories (a collective)."""
        model = self.model
        if reference:
            if self.ref_model is None:
                raise ValueError("no reference model: it exists only with algo.kl_coef or algo.kl_reward_coef > 0")
            model = self.ref_model
        lengths = [len(t.tokens) for t in trajectories]
        plan = pack_micro_batches(range(len(trajectories)), lengths, self.train_cfg.micro_batch_tokens,
                                  self._packs_sequences())
        out: list[list[float]] = [[] for _ in trajectories]
        mbs = self._build_micro_batches(trajectories, plan, None)
        for mb, logp in zip(mbs, self._no_grad_logprobs(model, mbs)):
            for i, row in zip(mb.indices, mb.rows_to_lists(logp)):
                out[i] = row
        return out

    def _given_or_computed(self, mbs: Sequence[MicroBatch], rows: list[list[float]] | None,
                           model: nn.Module | None) -> list[Tensor | None]:
        """Per micro-batch: the driver's rows laid on the grid, else ``model``'s logprobs, else None."""
        if rows is not None:
            return [to_grid(mb, rows) for mb in mbs]
        if model is None:
            return [None] * len(mbs)
        return list(self._no_grad_logprobs(model, mbs))

    # -- the step -----------------------------------------------------------------------------------
    def plan_steps(self, batch: TrainBatch) -> list[OptimizerStep]:
        """The batch as ``train.mini_batches`` optimizer steps on this data-parallel rank (``minibatch``).
        Old and reference logprobs are computed here, once, before any step changes the model."""
        trajs, cfg = batch.trajectories, self.train_cfg
        lengths = [len(t.tokens) for t in trajs]
        packed = self._packs_sequences()
        steps = []
        for mini in split_mini_batches([t.group_id for t in trajs], cfg.mini_batches):
            plan = [[mini[j] for j in mb] for mb in rank_plan([lengths[i] for i in mini], cfg.micro_batch_tokens,
                                                                self.dp_size, self.dp_rank, packed)]
            mbs = self._build_micro_batches(trajs, plan, batch.advantages, batch.teacher_logprobs)
            olds = self._given_or_computed(mbs, batch.old_logprobs,
                                           None if self.algo.use_rollout_logprobs else self.model)
            refs = self._given_or_computed(mbs, batch.ref_logprobs, self.ref_model)
            steps.append(OptimizerStep(mbs, olds, refs, normalizers(trajs, mini, self.algo.loss_agg)))
        return steps

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """``train.mini_batches`` x ``train.ppo_epochs`` optimizer steps over the batch. Within a step,
        micro-batches accumulate gradients of the loss normalized by that step's whole share, so the
        micro-batch split never changes the update. Metrics are means over the optimizer steps."""
        cfg = self.train_cfg
        steps = self.plan_steps(batch)
        self.model.train()
        sums: dict[str, Tensor] = {}
        grad_norms = []
        done, total = 0, cfg.ppo_epochs * sum(len(s.micro_batches) for s in steps)
        for epoch in range(cfg.ppo_epochs):
            for m, step in enumerate(steps):
                self.optimizer.zero_grad(set_to_none=True)
                # the mismatch is measured where the trainer's pre-update logprobs are known
                measure = epoch == 0 and (step.olds[0] is not None or m == 0)
                for metrics in self._backward_micro_batches(step, measure):
                    for k, v in metrics.items():
                        sums[k] = torch.maximum(sums[k], v) if k == "mismatch/abs_max" and k in sums \
                            else sums.get(k, 0.0) + v
                    done += 1
                    if self.on_micro_batch is not None:
                        self.on_micro_batch(done, total)
                grad_norms.append(self._optimizer_step())
        values, abs_max = self._sum_metric_shares(sums)
        return step_metrics(values, abs_max, grad_norms, batch.trajectories, len(steps), cfg.ppo_epochs,
                            float(self.optimizer.param_groups[0]["lr"]), self.step)

    # -- colocation: the device is the engines' while they generate (trainers/offload.py) ------------
    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state to host memory; call ``reload`` before any other call."""
        return self.memory.offload()

    def reload(self) -> dict[str, float]:
        return self.memory.reload()
