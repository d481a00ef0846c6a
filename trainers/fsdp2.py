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
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from miles_agent import true_on_policy
from miles_agent.algorithms.estimators import needs_reference
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.models.vision import mask_suppressed, suppressed_ids, vision_token_ids
from miles_agent.trainers import checkpoint as ckpt
from miles_agent.trainers import lora as lora_mod
from miles_agent.trainers import precision, qat, routing_replay, varlen
from miles_agent.trainers.batching import MicroBatch, add_images, pack
from miles_agent.trainers.logprobs import chunked_head, head_logprobs
from miles_agent.trainers.lora_options import LoraSection
from miles_agent.trainers.policy_trainer import PolicyTrainer, local_grad_norm
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


def shard(model: nn.Module, mesh: DeviceMesh, mp_policy: Any = None) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head), under the
    mixed-precision policy when given (``precision.fsdp_policy``)."""
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def check_memory_options(train: TrainConfig, algo: AlgoConfig) -> None:
    if train.logits_chunk_tokens < 0:
        raise UserError(f"train.logits_chunk_tokens must be >= 0 (0 = unchunked), got {train.logits_chunk_tokens}")
    if train.pack_sequences not in (True, False, "auto"):
        raise UserError(f"train.pack_sequences must be auto, true or false, got {train.pack_sequences!r}")
    if train.pack_sequences is True and algo.true_on_policy:
        raise UserError("train.pack_sequences and algo.true_on_policy are exclusive (true on-policy runs the "
                        "engine's kernels on one sequence per row); set train.pack_sequences=false or auto")


def packs_sequences(train: TrainConfig, algo: AlgoConfig) -> bool:
    """``train.pack_sequences`` resolved: auto packs unless true on-policy mode is on."""
    return train.pack_sequences is True or (train.pack_sequences == "auto" and not algo.true_on_policy)


class FSDP2Trainer(lora_mod.LoraSteps, PolicyTrainer):
    """Algorithm-blind policy trainer on FSDP2 (the step is ``PolicyTrainer``'s; these are its hooks)."""

    def __init__(self, model: nn.Module, tokenizer: Any, train: TrainConfig, algo: AlgoConfig, *,
                 temperature: float = 1.0, device: str = "cpu", lora: LoraSection | None = None) -> None:
        super().__init__(tokenizer, train, algo, temperature)
        self.lora = lora if lora is not None and lora.enabled else None  # LoRA: peft adapters train alone
        check_memory_options(train, algo)
        self.compute_dtype, master = precision.dtypes(model, train)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_group = init_distributed(self.device, train.world_size)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size  # FSDP2 shards data over every rank
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        if algo.routing_replay and algo.true_on_policy:
            raise UserError("algo.routing_replay and algo.true_on_policy are exclusive: true on-policy mode "
                            "already routes bit for bit like the engine; set algo.routing_replay=false")
        if algo.routing_replay:  # R3: MoE routers follow the engine's expert ids (hooks idle otherwise)
            routing_replay.install(model)
        if algo.true_on_policy:  # the engine's batch-invariant numerics: bitwise-equal logprobs
            true_on_policy.apply(model)
        self.pack = packs_sequences(train, algo)
        if self.pack:  # packed rows: causal SDPA per sequence (a no-op for unpacked forwards)
            varlen.install(model)
        self.ref_model: nn.Module | None = None
        if needs_reference(algo):  # a frozen copy of the initial policy in the compute dtype (not saved)
            self.ref_model = shard(copy.deepcopy(model).requires_grad_(False).eval().to(self.device), self.mesh)
        if train.activation_checkpointing:  # each decoder layer recomputed in backward (FSDP2-composable)
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        qat.install(model, train.qat)  # int4 QAT: the forward sees the engine's int4 rounding (STE)
        if self.lora is not None:  # after the reference copy: the reference is the base model
            model = lora_mod.wrap(model, self.lora)
        # fp32 master weights (upcasting bf16 is exact); FSDP2 casts them to the compute dtype to run
        self.model = shard(model.to(self.device, master), self.mesh,
                           precision.fsdp_policy(self.compute_dtype, master))
        ids = suppressed_ids(model)  # a VLM's image placeholders: out of its vocabulary, as in the engine
        self.suppressed = torch.tensor(ids, device=self.device) if ids else None
        self._init_optimizer()

    # -- hooks --------------------------------------------------------------------------------------
    def _forward_logprobs(self, model: nn.Module, mb: MicroBatch, entropy: bool = False,
                          entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logprobs (and entropy) on the grid, in fp32, from the LM head run a chunk at a time over the
        scored grid cells only (``logprobs``; 0 elsewhere: prompt and observation tokens are never read);
        packed micro-batches run one row with restarting positions."""
        if self.algo.true_on_policy:  # the engine's exact kernels over the whole logits
            return self._full_logits_logprobs(model, mb, entropy, entropy_grad)
        cells, chunk = mb.scored, self.train_cfg.logits_chunk_tokens
        if not bool(cells.any()):  # a filler micro-batch: its one real cell keeps the head in the graph
            cells = mb.real

        def head(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            h = hidden[0, mb.packed_src[cells]] if mb.packed_ids is not None else hidden[:, :-1][cells]
            logp, ent = head_logprobs(h, weight, bias, mb.targets[cells], self.temperature, chunk, entropy,
                                      entropy_grad, self.suppressed)
            return torch.stack([logp, ent], -1) if ent is not None else logp[:, None]

        with routing_replay.replaying(model, mb.routed_experts), chunked_head(model, head):
            if mb.packed_ids is not None:  # attention stays within each sequence (varlen, or transformers' mask)
                vals = model(input_ids=mb.packed_ids, position_ids=mb.packed_positions, use_cache=False,
                             **varlen.forward_kwargs(model, mb.packed_lengths, self.device)).logits
            else:
                vals = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=mb.keep,
                             use_cache=False, **mb.model_inputs()).logits
        zeros = torch.zeros(cells.shape, dtype=vals.dtype, device=vals.device)
        logp = zeros.masked_scatter(cells, vals[:, 0])
        return logp, zeros.masked_scatter(cells, vals[:, 1]) if entropy else None

    def _full_logits_logprobs(self, model: nn.Module, mb: MicroBatch, entropy: bool = False,
                              entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        with routing_replay.replaying(model, mb.routed_experts):
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=mb.keep,
                        use_cache=False, **mb.model_inputs())
        logits = out.logits[:, :-1].float() / self.temperature
        if self.suppressed is not None:
            logits = mask_suppressed(logits, self.suppressed)
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

    def _build_micro_batches(self, trajectories: Sequence[Trajectory], plan: list[list[int]],
                             advantages: Sequence[Sequence[float]] | None,
                             teacher: Sequence[Sequence[float]] | None = None) -> list[MicroBatch]:
        mbs = super()._build_micro_batches(trajectories, plan, advantages, teacher)
        vision = vision_token_ids(self.model)
        if vision is not None:  # image rows run padded: M-RoPE positions do not restart per packed sequence
            mbs = [add_images(mb, trajectories, vision[0]).to(self.device) for mb in mbs]
        if self.pack:
            mbs = [mb if mb.pixel_values is not None else pack(mb) for mb in mbs]
        if self.algo.routing_replay:
            routers = routing_replay.moe_routers(self.model)
            for mb in mbs:
                ids = routing_replay.layout(trajectories, mb.indices, mb.input_ids.shape[1], len(routers),
                                            routers[0].top_k)
                if mb.packed_lengths is not None:  # the packed row's tokens, row by row
                    ids = torch.cat([ids[b, :n] for b, n in enumerate(mb.packed_lengths)])[None]
                mb.routed_experts = ids.to(self.device)
        return mbs

    def _backward(self, loss: Tensor) -> None:
        # FSDP averages gradients over ranks; each rank's loss is its share of the global sum.
        (loss * self.world_size).backward()

    def _reduce_grads(self) -> None:
        """Nothing to do: FSDP2 reduce-scattered every gradient during backward."""

    def _grad_norm(self) -> Tensor:
        return local_grad_norm(list(self.model.parameters()))  # a DTensor: the norm over all shards

    def _dp_group(self) -> Any:
        return None  # the default group: every rank holds its own data

    def _packs_sequences(self) -> bool:
        return self.pack and vision_token_ids(self.model) is None  # image rows run padded

    def _optimized_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only

    # -- weights out --------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under the unwrapped HF ``state_dict`` names, one all-gather per tensor (tied
        weights share one), in the compute dtype (the engine's: fp32 masters are rounded to bf16 here).
        A collective: iterate it to the end on every rank. With LoRA: the adapter tensors only."""
        if self.lora is not None:
            yield from lora_mod.adapter_weights(self.model, self.compute_dtype)
            return
        seen: dict[tuple[int, tuple[int, ...]], Tensor] = {}
        for name, t in self.model.state_dict().items():
            local = t.to_local() if isinstance(t, DTensor) else t
            key = (local.data_ptr(), tuple(t.shape))
            if key not in seen:
                if isinstance(t, DTensor) and t.device_mesh.size() > 1:
                    full = t.full_tensor()
                else:  # one rank holds it all: its local tensor is the full one (a gather would only copy it)
                    full = local.detach()
                seen[key] = full.to(self.compute_dtype) if full.is_floating_point() else full
            yield name, seen[key]

    def save_hf(self, path: Path) -> None:
        """Rank 0 writes the policy as an HF folder via ``models.builder.save_hf`` (LoRA: the adapters, in
        peft's format, one folder each)."""
        if self.lora is not None:
            return lora_mod.save_adapters(self.model, self.lora, Path(path), self.rank)
        ckpt.save_hf(self.model, self.tokenizer, Path(path), self.rank, self.compute_dtype)

    def save_checkpoint(self, path: Path) -> None:
        ckpt.save(Path(path), self.model, self.optimizer, self.rank, {"step": self.step})
        if self.lora is not None:  # each adapter also in peft's format, next to the trainer state
            lora_mod.save_adapters(self.model, self.lora, Path(path) / "lora", self.rank)

    def load_checkpoint(self, path: Path) -> None:
        meta = ckpt.load(Path(path), self.model, self.optimizer, self.rank)
        self.step = int(meta.get("step", 0))

    def close(self) -> None:
        """Destroy the process group if this trainer created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
