"""The FSDP2 trainer: one code path for one CPU process, N CPU ranks (gloo) and N GPUs (NCCL).

Each decoder layer and the root model are wrapped with ``fully_shard``. Without a process group the
trainer creates a single-rank gloo group, so one process is just ``world_size=1`` of the N-rank code;
under torchrun or a Ray actor (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) it joins that group.

Data layout: every rank receives the *whole* ``TrainBatch`` and takes its own token-balanced share
(see ``batching``), so the driver needs no per-rank logic and the global loss normalizers are known
everywhere without communication. Methods that run collectives (``train_step``, ``named_weights``,
``compute_logprobs``, checkpointing, ``save_hf``) must be called on every rank.

``train.mini_batches`` x ``train.ppo_epochs`` optimizer steps per ``train_step`` (default one): the old
and reference logprobs are computed once, before the first step (see ``minibatch``). With one step,
every micro-batch's forward sees the pre-update weights, so the training forward also yields the
trainer/rollout logprob mismatch at no extra cost.
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
from miles_agent.algorithms import mismatch
from miles_agent.algorithms.estimators import needs_reference
from miles_agent.algorithms.losses import loss_options, validate_options
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.trainer import TrainBatch
from miles_agent.trainers import checkpoint as ckpt
from miles_agent.trainers import routing_replay
from miles_agent.trainers.batching import MicroBatch, build_micro_batch, pack_micro_batches
from miles_agent.trainers.lr_schedule import lr_at
from miles_agent.trainers.minibatch import plan_optimizer_steps, step_metrics, to_grid
from miles_agent.trainers.offload import DeviceOffload
from miles_agent.trainers.step_loss import micro_batch_loss
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
        mismatch.check_options(algo)
        if train.mini_batches < 1 or train.ppo_epochs < 1:
            raise UserError(f"train.mini_batches and train.ppo_epochs must be >= 1 (got {train.mini_batches}, "
                            f"{train.ppo_epochs})")
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
        if needs_reference(algo):  # a frozen copy of the initial policy, sharded the same way (not saved)
            self.ref_model = shard(copy.deepcopy(model).requires_grad_(False).eval().to(self.device), self.mesh)
        self.model = shard(model.to(self.device), self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas), eps=train.adam_eps,
                                           weight_decay=train.weight_decay)
        self._loss_opts = loss_options(algo)
        lr_at(train, 0)  # a bad schedule fails here, not at the first step
        self.memory = DeviceOffload(lambda: (self.model, self.ref_model), self.optimizer, self.device)

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

    def compute_logprobs(self, trajectories: Sequence[Trajectory], reference: bool = False) -> list[list[float]]:
        """Current-policy (or, with ``reference``, reference-policy) logprob per response position
        (0.0 where the model did not sample).

        Every rank computes all trajectories (same plan everywhere, so FSDP's collectives line up)."""
        model = self.model
        if reference:
            if self.ref_model is None:
                raise ValueError("no reference model: it exists only with algo.kl_coef or algo.kl_reward_coef > 0")
            model = self.ref_model
        lengths = [len(t.tokens) for t in trajectories]
        plan = pack_micro_batches(range(len(trajectories)), lengths, self.train_cfg.micro_batch_tokens)
        out: list[list[float]] = [[] for _ in trajectories]
        for mb in self._micro_batches(trajectories, plan, None):
            (logp,) = self._no_grad_logps(model, [mb])
            for i, row in zip(mb.indices, mb.rows_to_lists(logp)):
                out[i] = row
        return out

    # -- the step -----------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """``train.mini_batches`` x ``train.ppo_epochs`` optimizer steps over the batch. Within a step,
        micro-batches accumulate gradients of the loss normalized by that step's whole share, so the
        micro-batch split never changes the update. Metrics are means over the optimizer steps."""
        trajs, cfg = batch.trajectories, self.train_cfg
        steps = plan_optimizer_steps(self, batch, self.world_size, self.rank)  # per mini-batch: mbs, olds, refs, norms
        self.model.train()
        sums: dict[str, Tensor] = {}
        grad_norms = []
        done, total = 0, cfg.ppo_epochs * sum(len(step[0]) for step in steps)
        for epoch in range(cfg.ppo_epochs):
            for m, (mbs, olds, refs, norm) in enumerate(steps):
                self.optimizer.zero_grad(set_to_none=True)
                # the mismatch is measured where the trainer's pre-update logprobs are known
                measure = epoch == 0 and (olds[0] is not None or m == 0)
                for mb, old, ref in zip(mbs, olds, refs):
                    for k, v in self._micro_step(mb, old, ref, norm, measure).items():
                        sums[k] = torch.maximum(sums[k], v) if k == "mismatch/abs_max" and k in sums \
                            else sums.get(k, 0.0) + v
                    done += 1
                    if self.on_micro_batch is not None:
                        self.on_micro_batch(done, total)
                grad_norms.append(self._clip_and_step())
        return self._reduce_metrics(sums, grad_norms, len(steps), trajs)

    def _given_or_computed(self, mbs: Sequence[MicroBatch], rows: list[list[float]] | None,
                           model: nn.Module | None) -> list[Tensor | None]:
        """Per micro-batch: the driver's rows laid on the grid, else ``model``'s logprobs, else None."""
        if rows is not None:
            return [to_grid(mb, rows) for mb in mbs]
        if model is None:
            return [None] * len(mbs)
        return list(self._no_grad_logps(model, mbs))

    def _micro_step(self, mb: MicroBatch, old: Tensor | None, ref: Tensor | None, norm: dict,
                    measure: bool) -> dict[str, Tensor]:
        logp, entropy = self._logp(self.model, mb, entropy=True, entropy_grad=self.algo.entropy_coef != 0)
        loss, metrics = micro_batch_loss(self.algo, self._loss_opts, logp, entropy, mb, old, ref, norm, measure)
        # FSDP averages gradients over ranks; each rank's loss is its share of the global sum.
        (loss * self.world_size).backward()
        return metrics

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

    def _reduce_metrics(self, sums: dict[str, Tensor], grad_norms: list[float], n_minis: int,
                        trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Sum over ranks, then: loss metrics as means over optimizer steps, mismatch metrics per token."""
        mx = sums.pop("mismatch/abs_max", torch.zeros((), device=self.device))
        names = sorted(sums)
        values: dict[str, float] = {}
        if names:
            stacked = torch.stack([torch.as_tensor(sums[k], device=self.device).float() for k in names])
            if self.world_size > 1:
                dist.all_reduce(stacked)
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            values = dict(zip(names, stacked.tolist()))
        return step_metrics(values, float(mx), grad_norms, trajs, n_minis, self.train_cfg.ppo_epochs,
                            float(self.optimizer.param_groups[0]["lr"]), self.step)

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

    # -- colocation: the device is the engines' while they generate (trainers/offload.py) ------------
    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state to host memory; call ``reload`` before any other call."""
        return self.memory.offload()

    def reload(self) -> dict[str, float]:
        return self.memory.reload()

    def close(self) -> None:
        """Destroy the process group if this trainer created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
