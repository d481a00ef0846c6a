"""The FSDP2 trainer: one code path for one CPU process, N CPU ranks (gloo) and N GPUs (NCCL).

Each decoder layer and the root model are wrapped with ``fully_shard``. Without a process group the
trainer creates a single-rank gloo group, so one process is just ``world_size=1`` of the N-rank code;
under torchrun or a Ray actor (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) it joins that group.

Data layout: every rank receives the *whole* ``TrainBatch`` and takes its own token-balanced share
(see ``batching``), so the driver needs no per-rank logic and the global loss normalizers are known
everywhere without communication. Methods that run collectives (``train_step``, ``named_weights``,
``compute_logprobs``, checkpointing, ``save_hf``) must be called on every rank.

One optimizer step per ``train_step``: every micro-batch's forward sees the pre-update weights, so
the training forward also yields the trainer/rollout logprob mismatch at no extra cost.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from miles_agent import true_on_policy
from miles_agent.algorithms.distill import distill_loss
from miles_agent.algorithms.losses import compute_loss, loss_options, validate_options
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.trainer import TrainBatch
from miles_agent.trainers import checkpoint as ckpt
from miles_agent.trainers import routing_replay
from miles_agent.trainers.batching import MicroBatch, build_micro_batch, pack_micro_batches, rank_plan
from miles_agent.trainers.lr_schedule import lr_at
from miles_agent.types import Trajectory


def init_distributed(device: torch.device, world_size: int) -> bool:
    """Join (torchrun / Ray env vars) or create (single rank, in-memory store) the default process
    group; returns whether this call created it. gloo carries CPU tensors, NCCL CUDA ones."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        created = False
    elif all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(backend=backend)
        created = True
    elif world_size == 1:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    else:
        raise UserError(f"train.world_size={world_size} needs {world_size} processes; launch them with "
                        f"torchrun --nproc-per-node {world_size} (or the Ray launcher), or set train.world_size=1")
    if dist.get_world_size() != world_size:
        raise UserError(f"train.world_size={world_size} but the process group has {dist.get_world_size()} "
                        "ranks; make them agree")
    return created


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one (HF keeps them in ``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    found = [m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)]
    if not found:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__} to shard with FSDP2")
    return list(found[0])


def shard(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head)."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDP2Trainer:
    """Algorithm-blind policy trainer (see ``miles_agent.trainer.Trainer``)."""

    def __init__(self, model: nn.Module, tokenizer: Any, train: TrainConfig, algo: AlgoConfig, *,
                 temperature: float = 1.0, device: str = "cpu") -> None:
        validate_options(algo)
        if not temperature > 0:
            raise UserError(f"temperature must be > 0 (got {temperature}); logits are divided by it")
        self.train_cfg, self.algo, self.temperature = train, algo, float(temperature)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_group = init_distributed(self.device, train.world_size)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.step = 0
        if algo.routing_replay and algo.true_on_policy:
            raise UserError("algo.routing_replay and algo.true_on_policy are exclusive: true on-policy mode "
                            "already routes bit for bit like the engine; set algo.routing_replay=false")
        if algo.routing_replay:  # R3: MoE routers follow the engine's expert ids (hooks idle otherwise)
            routing_replay.install(model)
        if algo.true_on_policy:  # the engine's batch-invariant numerics: bitwise-equal logprobs
            true_on_policy.apply(model)
        self.on_micro_batch: Callable[[int, int], None] | None = None  # (done, total): the live view's hook
        self.ref_model: nn.Module | None = None
        if algo.kl_coef > 0:  # a frozen copy of the initial policy, sharded the same way (not saved)
            self.ref_model = shard(copy.deepcopy(model).requires_grad_(False).eval().to(self.device), self.mesh)
        self.model = shard(model.to(self.device), self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas), eps=train.adam_eps,
                                           weight_decay=train.weight_decay)
        self._loss_opts = loss_options(algo)
        lr_at(train, 0)  # a bad schedule fails here, not at the first step

    # -- forward ------------------------------------------------------------------------------------
    def _logp(self, model: nn.Module, mb: MicroBatch, entropy: bool = False,
              entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logprob of each grid target at ``temperature`` (the engine's convention), plus the full
        distribution's entropy when asked (with gradient only when it is part of the loss)."""
        with routing_replay.replaying(model, mb.routed_experts):
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=mb.keep,
                        use_cache=False)
        logits = out.logits[:, :-1].float() / self.temperature
        lse = torch.logsumexp(logits, dim=-1)
        if self.algo.true_on_policy:
            logp = true_on_policy.log_softmax(logits).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
        else:
            logp = logits.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1) - lse
        ent = None
        if entropy:
            src, lse_e = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = lse_e - (torch.softmax(src, -1) * src).sum(-1)
        return logp, ent

    @torch.no_grad()
    def _no_grad_logps(self, model: nn.Module, mbs: Sequence[MicroBatch]) -> list[Tensor]:
        model.eval()
        return [self._logp(model, mb)[0] for mb in mbs]

    def _micro_batches(self, trajectories: Sequence[Trajectory], plan: list[list[int]],
                       advantages: Sequence[Sequence[float]] | None,
                       teacher: Sequence[Sequence[float]] | None = None) -> list[MicroBatch]:
        mbs = [build_micro_batch(trajectories, idx, advantages, self.pad_id, teacher) for idx in plan]
        if self.algo.routing_replay:
            routers = routing_replay.moe_routers(self.model)
            for mb in mbs:
                mb.routed_experts = routing_replay.layout(trajectories, mb.indices, mb.input_ids.shape[1],
                                                          len(routers), routers[0].top_k)
        return [mb.to(self.device) for mb in mbs]

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Current-policy logprob per response position (0.0 where the model did not sample).

        Every rank computes all trajectories (same plan everywhere, so FSDP's collectives line up)."""
        lengths = [len(t.tokens) for t in trajectories]
        plan = pack_micro_batches(range(len(trajectories)), lengths, self.train_cfg.micro_batch_tokens)
        out: list[list[float]] = [[] for _ in trajectories]
        for mb in self._micro_batches(trajectories, plan, None):
            (logp,) = self._no_grad_logps(self.model, [mb])
            for i, row in zip(mb.indices, mb.rows_to_lists(logp)):
                out[i] = row
        return out

    # -- the step -----------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the whole batch: micro-batches accumulate gradients of the loss
        normalized by the global batch, so the split never changes the update."""
        trajs = batch.trajectories
        plan = rank_plan([len(t.tokens) for t in trajs], self.train_cfg.micro_batch_tokens,
                         self.world_size, self.rank)
        mbs = self._micro_batches(trajs, plan, batch.advantages, batch.teacher_logprobs)
        norm = {"num_tokens": float(sum(sum(t.loss_mask) for t in trajs)),
                "num_seqs": float(sum(1 for t in trajs if any(t.loss_mask)))}
        olds: list[Tensor | None] = [None] * len(mbs)
        if not self.algo.use_rollout_logprobs:
            olds = list(self._no_grad_logps(self.model, mbs))
        refs: list[Tensor | None] = [None] * len(mbs)
        if self.ref_model is not None:
            refs = list(self._no_grad_logps(self.ref_model, mbs))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Tensor] = {}
        mismatch_max = torch.zeros((), device=self.device)
        for i, (mb, old, ref) in enumerate(zip(mbs, olds, refs)):
            metrics, mb_max = self._micro_step(mb, old, ref, norm)
            if self.on_micro_batch is not None:
                self.on_micro_batch(i + 1, len(mbs))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            mismatch_max = torch.maximum(mismatch_max, mb_max)
        grad_norm = self._clip_and_step()
        return self._reduce_metrics(sums, mismatch_max, grad_norm, norm)

    def _micro_step(self, mb: MicroBatch, old: Tensor | None, ref: Tensor | None,
                    norm: dict[str, float]) -> tuple[dict[str, Tensor], Tensor]:
        logp, entropy = self._logp(self.model, mb, entropy=True, entropy_grad=self.algo.entropy_coef != 0)
        loss, metrics = compute_loss(logp, mb.rollout_logp if old is None else old, mb.advantages, mb.loss_mask,
                                     ref_logp=ref, entropy=entropy, **self._loss_opts, **norm)
        if mb.teacher_logp is not None:  # on-policy distillation in loss mode (algorithms/distill.py)
            term, extra = distill_loss(logp, mb.teacher_logp, mb.loss_mask, coef=self.algo.distill_coef,
                                       loss_agg=self.algo.loss_agg, **norm)
            loss, metrics = loss + term, {**metrics, **extra, "loss": metrics["loss"] + extra["distill_loss"]}
        # FSDP averages gradients over ranks; each rank's loss is its share of the global sum.
        (loss * self.world_size).backward()
        diff = (logp.detach() - mb.rollout_logp).abs() * mb.loss_mask
        metrics["logprob_mismatch_mean"] = diff.sum() / max(norm["num_tokens"], 1.0)
        return metrics, diff.max() if diff.numel() else torch.zeros((), device=self.device)

    def _clip_and_step(self) -> float:
        """Clip to ``train.grad_clip`` (<= 0: measure only) and step; a non-finite norm skips the step."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        total = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        if isinstance(total, DTensor):
            total = total.full_tensor()
        grad_norm = float(total)
        if math.isfinite(grad_norm):
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.train_cfg, self.step)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return grad_norm

    def _reduce_metrics(self, sums: dict[str, Tensor], mismatch_max: Tensor, grad_norm: float,
                        norm: dict[str, float]) -> dict[str, float]:
        names = sorted(sums)
        if names:
            stacked = torch.stack([torch.as_tensor(sums[k], device=self.device).float() for k in names])
            if self.world_size > 1:
                dist.all_reduce(stacked)
                dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX)
            values = dict(zip(names, stacked.tolist()))
        else:
            values = {}
        values.update(logprob_mismatch_max=float(mismatch_max), grad_norm=grad_norm,
                      lr=float(self.optimizer.param_groups[0]["lr"]), tokens=norm["num_tokens"],
                      seqs=norm["num_seqs"], step=float(self.step),
                      skipped_step=0.0 if math.isfinite(grad_norm) else 1.0)
        return values

    # -- weights out --------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under the unwrapped HF ``state_dict`` names, one all-gather per tensor (tied
        weights share one). A collective: iterate it to the end on every rank."""
        seen: dict[tuple[int, tuple[int, ...]], Tensor] = {}
        for name, t in self.model.state_dict().items():
            local = t.to_local() if isinstance(t, DTensor) else t
            key = (local.data_ptr(), tuple(t.shape))
            if key not in seen:
                seen[key] = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            yield name, seen[key]

    def save_hf(self, path: Path) -> None:
        """Rank 0 writes the policy as an HF folder via ``models.builder.save_hf``."""
        ckpt.save_hf(self.model, self.tokenizer, Path(path), self.rank)

    def save_checkpoint(self, path: Path) -> None:
        ckpt.save(Path(path), self.model, self.optimizer, self.rank, {"step": self.step})

    def load_checkpoint(self, path: Path) -> None:
        meta = ckpt.load(Path(path), self.model, self.optimizer, self.rank)
        self.step = int(meta.get("step", 0))

    def close(self) -> None:
        """Destroy the process group if this trainer created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
