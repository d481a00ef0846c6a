"""The Megatron-core trainer backend: same contract and the same losses as the FSDP2 trainer.

The policy arrives as an HF model (what ``load_policy`` builds); its weights are converted once into
this rank's shard of a Megatron GPTModel (bridge.py, sharding.py). A step lays the batch out with the
FSDP2 trainer's micro-batch code, computes logprobs with Megatron's vocab-parallel cross entropy, and
applies ``compute_loss`` from miles_agent.algorithms -- so an algorithm never knows the backend.
Weights leave in the engine's HF names (``named_weights``), so every weight-sync transport works.

Parallelism: tensor, expert, data and pipeline parallel (Megatron's 1F1B schedule, ``pipeline.py``);
context parallel is refused. Gradients are completed as Megatron's ``finalize_model_grads`` does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_agent.algorithms import mismatch
from miles_agent.algorithms.estimators import needs_reference
from miles_agent.algorithms.losses import loss_options, validate_options
from miles_agent.atomic import replace_dir
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError, require
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.batching import MicroBatch, build_micro_batch, pack_micro_batches
from miles_agent.trainers.fsdp2 import init_distributed
from miles_agent.trainers.lr_schedule import lr_at
from miles_agent.trainers.megatron import bridge
from miles_agent.trainers.megatron.model import ParallelSizes, build_gpt, padded_vocab
from miles_agent.trainers.megatron.options import MegatronConfig
from miles_agent.trainers.megatron.sharding import RankCoords, merge, shard
from miles_agent.trainers.minibatch import plan_optimizer_steps, step_metrics, to_grid
from miles_agent.trainers.offload import DeviceOffload
from miles_agent.trainers.step_loss import micro_batch_loss
from miles_agent.types import Trajectory


class MegatronTrainer:
    """Algorithm-blind policy trainer on Megatron-core (see ``miles_agent.trainer.Trainer``)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, train: TrainConfig, algo: AlgoConfig, *,
                 temperature: float = 1.0, device: str = "cpu", megatron: MegatronConfig | None = None) -> None:
        require("megatron.core", "megatron", "the Megatron-core trainer backend")
        from megatron.core import parallel_state as ps

        validate_options(algo)
        mismatch.check_options(algo)
        if train.mini_batches < 1 or train.ppo_epochs < 1:
            raise UserError(f"train.mini_batches and train.ppo_epochs must be >= 1 (got {train.mini_batches}, "
                            f"{train.ppo_epochs})")
        if not temperature > 0:
            raise UserError(f"temperature must be > 0 (got {temperature}); logits are divided by it")
        for name in ("routing_replay", "true_on_policy"):
            if getattr(algo, name):
                raise UserError(f"algo.{name} is implemented by the fsdp2 trainer only; set train.backend=fsdp2 "
                                f"or algo.{name}=false")
        mcfg = megatron or MegatronConfig()
        self.sizes = ParallelSizes(tensor=mcfg.tensor_parallel, pipeline=mcfg.pipeline_parallel,
                                   expert=mcfg.expert_parallel, context=mcfg.context_parallel,
                                   expert_tensor=mcfg.expert_tensor_parallel,
                                   first_stage_layers=mcfg.first_stage_layers, last_stage_layers=mcfg.last_stage_layers)
        if self.sizes.context > 1:
            raise UserError("megatron.context_parallel > 1 is not wired into the training step yet (the "
                            "micro-batches are not split along the sequence); use megatron.context_parallel=1")
        self.spec = bridge.arch_spec(model.config)
        if self.sizes.pipeline > 1 and self.spec.is_moe and not torch.cuda.is_available():
            raise UserError("megatron.pipeline_parallel > 1 with an MoE model needs Megatron's alltoall token "
                            "dispatcher, which needs CUDA; on CPU use tensor/expert/data parallelism for MoE")
        self.train_cfg, self.algo, self.temperature = train, algo, float(temperature)
        self.tokenizer, self.device = tokenizer, torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._owns_group = init_distributed(self.device, train.world_size)  # the FSDP2 backend's join-or-create
        self.sizes.check(self.spec, dist.get_world_size())
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(self.sizes.tensor, self.sizes.pipeline,
                                         expert_model_parallel_size=self.sizes.expert,
                                         expert_tensor_parallel_size=self.sizes.expert_tensor)
        if self.device.type == "cpu":
            from miles_agent.trainers.megatron import cpu_compat

            cpu_compat.enable()
        self.hf_config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.coords = RankCoords(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                 ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        dtype = next(model.parameters()).dtype
        full = bridge.hf_to_megatron(bridge.hf_checkpoint_tensors(model), self.spec,
                                     padded_vocab(self.spec, self.sizes.tensor))
        local = shard(full, self.spec, self.sizes, self.coords)
        del full
        self.model = self._build_loaded(local, dtype)
        self.ref_model: torch.nn.Module | None = None
        if needs_reference(algo):  # a frozen copy of the initial policy, sharded the same way (not saved)
            self.ref_model = self._build_loaded(local, dtype).requires_grad_(False).eval()
        del local
        self.on_micro_batch: Callable[[int, int], None] | None = None  # (done, total): the live view's hook
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas),
                                           eps=train.adam_eps, weight_decay=train.weight_decay)
        self._loss_opts = loss_options(algo)
        self.step = 0
        lr_at(train, 0)
        self.memory = DeviceOffload(lambda: (self.model, self.ref_model), self.optimizer, self.device)

    def _build_loaded(self, local: dict[str, Tensor], dtype: torch.dtype) -> torch.nn.Module:
        """This rank's GPTModel holding ``local`` (its shard of the converted weights)."""
        gpt = build_gpt(self.spec, self.sizes, dtype).to(self.device)
        missing, unexpected = gpt.load_state_dict(local, strict=False)
        if unexpected or any(not k.endswith("_extra_state") for k in missing):
            raise RuntimeError(f"converted weights do not fit the Megatron model: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        return gpt

    # -- forward ------------------------------------------------------------------------------------
    def _forward(self, model: torch.nn.Module, mb: MicroBatch) -> Tensor:
        """This stage's output for ``mb``: the logits on the last pipeline stage, hidden states before it
        (a later stage's input arrives through Megatron's ``set_input_tensor``)."""
        ids = self._common_shape(mb.input_ids)
        b, length = ids.shape
        positions = torch.arange(length, device=ids.device).expand(b, -1)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=ids.device), 1)[None, None]
        return model(ids, positions, causal)

    def _logp(self, model: torch.nn.Module, mb: MicroBatch, entropy: bool = False, entropy_grad: bool = False
              ) -> tuple[Tensor, Tensor | None]:
        return self._logits_logp(self._forward(model, mb), mb, entropy, entropy_grad)

    def _logits_logp(self, output: Tensor, mb: MicroBatch, entropy: bool = False, entropy_grad: bool = False
                     ) -> tuple[Tensor, Tensor | None]:
        """Logprob of each grid target at ``temperature``, vocabulary-parallel across TP ranks; padded
        vocabulary rows are excluded from the softmax."""
        from megatron.core import tensor_parallel

        rows, cols = mb.targets.shape
        logits = output[:rows, mb.offset:mb.offset + cols].float() / self.temperature
        logits = self._mask_padded_vocab(logits)
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb.targets)
        ent = None
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = self._vocab_parallel_entropy(logits if entropy_grad else logits.detach())
        return logp, ent

    def _common_shape(self, ids: Tensor) -> Tensor:
        """``ids`` padded (extra pad rows below, pad columns right) to the largest micro-batch among the
        ranks whose tokens Megatron's all-gather MoE dispatcher (the CPU one) gathers: it needs equal
        shapes, and data-parallel ranks hold different micro-batches. The padding is causal-invisible to
        the real tokens, routed without capacity limits, and cut off before the loss."""
        from megatron.core import parallel_state as ps

        if not (self.spec.is_moe and self.model.config.moe_token_dispatcher_type == "allgather"
                and self.sizes.expert * self.sizes.expert_tensor > 1):
            return ids
        shape = torch.tensor(ids.shape, device=ids.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=ps.get_expert_tensor_and_model_parallel_group())
        b, length = (int(x) for x in shape)
        if (b, length) == tuple(ids.shape):
            return ids
        out = ids.new_full((b, length), self.pad_id)
        out[:ids.shape[0], :ids.shape[1]] = ids
        return out

    def _mask_padded_vocab(self, logits: Tensor) -> Tensor:
        per_rank = logits.shape[-1]
        start = self.coords.tensor * per_rank
        real = self.spec.vocab_size - start
        if real >= per_rank:
            return logits
        return torch.cat([logits[..., :max(real, 0)],
                          logits.new_full((*logits.shape[:-1], per_rank - max(real, 0)), -math.inf)], dim=-1)

    def _vocab_parallel_entropy(self, logits: Tensor) -> Tensor:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

        m = logits.detach().amax(-1, keepdim=True)
        if self.sizes.tensor > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        z = logits - m
        finite = torch.isfinite(z)
        e = torch.where(finite, z.exp(), torch.zeros((), device=z.device))
        total = tp_sum(e.sum(-1))
        lse = total.log()
        p_z = tp_sum((e * torch.where(finite, z, torch.zeros((), device=z.device))).sum(-1)) / total
        return lse - p_z

    def _micro_batches(self, trajectories: Sequence[Trajectory], plan: list[list[int]],
                       advantages: Sequence[Sequence[float]] | None,
                       teacher: Sequence[Sequence[float]] | None = None) -> list[MicroBatch]:
        return [build_micro_batch(trajectories, idx, advantages, self.pad_id, teacher).to(self.device)
                for idx in plan]

    @torch.no_grad()
    def _no_grad_logps(self, model: torch.nn.Module, mbs: Sequence[MicroBatch]) -> list[Tensor]:
        """Every micro-batch's logprobs, on every rank (pipeline: computed on the last stage, broadcast)."""
        model.eval()
        if self.sizes.pipeline == 1:
            return [self._logp(model, mb)[0] for mb in mbs]
        from miles_agent.trainers.megatron import pipeline

        def loss_func(mb: MicroBatch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logp = self._logits_logp(output, mb)[0]
            return logp.sum() * 0.0, {"logp": logp}

        outs = pipeline.run(model, mbs, self._forward, loss_func, forward_only=True)
        return pipeline.from_last_stage([o["logp"] for o in outs] if outs else None,
                                        [mb.targets.shape for mb in mbs], self.device)

    def compute_logprobs(self, trajectories: Sequence[Trajectory], reference: bool = False) -> list[list[float]]:
        """Current-policy (or, with ``reference``, reference-policy) logprob per response position
        (0.0 where the model did not sample). Every rank computes all trajectories (a collective)."""
        model = self.model
        if reference:
            if self.ref_model is None:
                raise ValueError("no reference model: it exists only with algo.kl_coef or algo.kl_reward_coef > 0")
            model = self.ref_model
        lengths = [len(t.tokens) for t in trajectories]
        plan = pack_micro_batches(range(len(trajectories)), lengths, self.train_cfg.micro_batch_tokens)
        out: list[list[float]] = [[] for _ in trajectories]
        mbs = self._micro_batches(trajectories, plan, None)
        for mb, logp in zip(mbs, self._no_grad_logps(model, mbs)):
            for i, row in zip(mb.indices, mb.rows_to_lists(logp)):
                out[i] = row
        return out

    # -- the step -----------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """``train.mini_batches`` x ``train.ppo_epochs`` optimizer steps, laid out exactly as the FSDP2
        trainer lays them out (``minibatch``): the old and reference logprobs are computed once, before the
        first step; each step's loss is normalized by its own share. Metrics are means over the steps."""
        trajs, cfg = batch.trajectories, self.train_cfg
        steps = plan_optimizer_steps(self, batch, self.dp_size, self.dp_rank)  # per mini-batch: mbs, olds, refs, norms
        self.model.train()
        sums: dict[str, Tensor] = {}
        grad_norms = []
        done, total = 0, cfg.ppo_epochs * sum(len(step[0]) for step in steps)
        for epoch in range(cfg.ppo_epochs):
            for m, (mbs, olds, refs, norm) in enumerate(steps):
                self.optimizer.zero_grad(set_to_none=True)
                # the mismatch is measured where the trainer's pre-update logprobs are known
                measure = epoch == 0 and (olds[0] is not None or m == 0)
                for metrics in self._backward_micro_batches(mbs, olds, refs, norm, measure):
                    for k, v in metrics.items():
                        sums[k] = torch.maximum(sums[k], v) if k == "mismatch/abs_max" and k in sums \
                            else sums.get(k, 0.0) + v
                    done += 1
                    if self.on_micro_batch is not None:
                        self.on_micro_batch(done, total)
                grad_norms.append(self._clip_and_step())
        return self._reduce_metrics(sums, grad_norms, len(steps), trajs)

    def _given_or_computed(self, mbs: Sequence[MicroBatch], rows: list[list[float]] | None,
                           model: torch.nn.Module | None) -> list[Tensor | None]:
        """Per micro-batch: the driver's rows laid on the grid, else ``model``'s logprobs, else None."""
        if rows is not None:
            return [to_grid(mb, rows) for mb in mbs]
        if model is None:
            return [None] * len(mbs)
        return self._no_grad_logps(model, mbs)

    def _backward_micro_batches(self, mbs: Sequence[MicroBatch], olds: Sequence[Tensor | None],
                                refs: Sequence[Tensor | None], norm: dict, measure: bool
                                ) -> Iterator[dict[str, Tensor]]:
        """Forward and backward of one optimizer step's micro-batches; their metric shares (with pipeline
        parallelism: Megatron's 1F1B schedule, the metrics on the last stage only)."""
        entropy_grad = self.algo.entropy_coef != 0
        if self.sizes.pipeline == 1:
            for mb, old, ref in zip(mbs, olds, refs):
                logp, entropy = self._logp(self.model, mb, entropy=True, entropy_grad=entropy_grad)
                loss, metrics = micro_batch_loss(self.algo, self._loss_opts, logp, entropy, mb, old, ref, norm,
                                                 measure)
                loss.backward()  # each data-parallel rank's loss is its share of the global sum (_sync_grads)
                yield metrics
            return
        from miles_agent.trainers.megatron import pipeline

        extra = {id(mb): (old, ref) for mb, old, ref in zip(mbs, olds, refs)}

        def loss_func(mb: MicroBatch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logp, entropy = self._logits_logp(output, mb, entropy=True, entropy_grad=entropy_grad)
            return micro_batch_loss(self.algo, self._loss_opts, logp, entropy, mb, *extra[id(mb)], norm,
                                    measure)

        yield from pipeline.run(self.model, mbs, self._forward, loss_func, forward_only=False)

    def _sync_grads(self) -> None:
        """Complete the gradients Megatron leaves partial (its ``finalize_model_grads`` rules, without its
        DDP wrapper): replicated weights that see only this rank's heads (q/k norms) or sequence shard
        are summed over tensor-parallel ranks; then every gradient is summed over data-parallel ranks
        (expert weights over their expert-data-parallel ranks)."""
        from megatron.core import parallel_state as ps

        if dist.get_world_size() == 1:
            return
        tp_group = ps.get_tensor_model_parallel_group()
        dense = ps.get_data_parallel_group(with_context_parallel=True)
        experts = ps.get_expert_data_parallel_group()
        seq_parallel = self.model.config.sequence_parallel
        if self.sizes.pipeline > 1 and self.spec.tied_embeddings and ps.is_rank_in_embedding_group():
            # tied embeddings: the first stage's input embedding and the last stage's output layer are one
            # weight held twice; both copies get the sum of their gradients
            shared = self.model.shared_embedding_or_output_weight()
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())
        for name, p in self.model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.sizes.tensor > 1:
                if getattr(p, "average_gradients_across_tp_domain", False):
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=tp_group)
                elif "q_layernorm" in name or "k_layernorm" in name or (
                        seq_parallel and getattr(p, "sequence_parallel", False)):
                    dist.all_reduce(p.grad, group=tp_group)
            group = experts if ".local_experts." in name else dense
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)

    def _clip_and_step(self) -> float:
        """Sum the gradients over data-parallel ranks, clip by the global norm over the model-parallel
        shards (replicated tensors counted once), step; a non-finite norm skips the step."""
        from megatron.core import parallel_state as ps

        self._sync_grads()
        # dense weights: distinct shards over the model-parallel (tensor x pipeline) ranks, TP-replicated
        # ones counted once; expert weights: distinct over the expert-tensor x expert x pipeline ranks
        dense, experts = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            if getattr(p, "shared", False):
                continue  # the last stage's copy of tied embeddings: counted on the first stage
            if ".local_experts." in name:
                experts += p.grad.float().pow(2).sum()
            elif getattr(p, "tensor_model_parallel", False) or self.coords.tensor == 0:
                dense += p.grad.float().pow(2).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
            if self.spec.is_moe:
                dist.all_reduce(experts, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        sq = dense + experts
        grad_norm = float(sq.sqrt())
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        if math.isfinite(grad_norm):
            if grad_norm > max_norm:
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(max_norm / (grad_norm + 1e-6))
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.train_cfg, self.step)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return grad_norm

    def _reduce_metrics(self, sums: dict[str, Tensor], grad_norms: list[float], n_minis: int,
                        trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Sum the metric shares over data-parallel ranks (tensor-parallel ranks hold the same values),
        then the FSDP2 trainer's summary (``minibatch.step_metrics``)."""
        from megatron.core import parallel_state as ps

        mx = sums.pop("mismatch/abs_max", torch.zeros((), device=self.device))
        names = sorted(sums)
        values: dict[str, float] = {}
        if names:
            stacked = torch.stack([torch.as_tensor(sums[k], device=self.device).float() for k in names])
            if self.dp_size > 1:
                group = ps.get_data_parallel_group()
                dist.all_reduce(stacked, group=group)
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            values = dict(zip(names, stacked.tolist()))
        if self.sizes.pipeline > 1:  # the losses ran on the last stage
            from miles_agent.trainers.megatron import pipeline

            values, mx = pipeline.object_from_last_stage((values, float(mx)))
        return step_metrics(values, float(mx), grad_norms, trajs, n_minis, self.train_cfg.ppo_epochs,
                            float(self.optimizer.param_groups[0]["lr"]), self.step)

    # -- weights out --------------------------------------------------------------------------------
    def _full_hf_state(self) -> dict[str, Tensor]:
        """Every rank's shard gathered and merged, in HF checkpoint names (a collective)."""
        local = {k: v.detach().cpu() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        if dist.get_world_size() == 1:
            states = {self.coords: local}
        else:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.coords, local))
            states = dict(gathered)
        return bridge.megatron_to_hf(merge(states, self.spec, self.sizes), self.spec)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under the engine's (transformers') parameter names. A collective."""
        state = bridge.to_transformers_layout(self._full_hf_state(), self.spec)
        yield from ((k, v.to(self.device)) for k, v in state.items())

    def save_hf(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        from miles_agent.models.builder import save_hf as write_hf

        state = bridge.to_transformers_layout(self._full_hf_state(), self.spec)
        if dist.get_rank() == 0:
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(self.hf_config)
            missing, unexpected = shell.load_state_dict(state, assign=True, strict=False)
            if unexpected or any("lm_head" not in k for k in missing):
                raise RuntimeError(f"exported weights do not fit the HF model: {missing[:3]} {unexpected[:3]}")
            shell.tie_weights()
            if self.generation_config is not None:
                shell.generation_config = self.generation_config
            write_hf(shell, self.tokenizer, path)
        dist.barrier()

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """Each rank writes its own shard and optimizer state; the folder appears atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        torch.save({"coords": self.coords, "model": self.model.state_dict(),
                    "optim": self.optimizer.state_dict(), "rng": torch.get_rng_state()}, tmp / f"rank{rank}.pt")
        if rank == 0:
            meta = {"step": self.step, "world_size": dist.get_world_size(), "sizes": self.sizes.__dict__}
            (tmp / "meta.json").write_text(json.dumps(meta))
        dist.barrier()
        if rank == 0:
            replace_dir(tmp, path)
        dist.barrier()

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            raise UserError(f"{path} is not a Megatron trainer checkpoint (no meta.json)")
        meta = json.loads(meta_file.read_text())
        if meta["world_size"] != dist.get_world_size() or meta["sizes"] != self.sizes.__dict__:
            raise UserError(f"checkpoint {path} was written with {meta['world_size']} ranks and sizes "
                            f"{meta['sizes']}; resume with the same layout (or export with save_hf and restart)")
        state = torch.load(path / f"rank{dist.get_rank()}.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        self.step = int(meta["step"])

    # -- colocation: the same storage-level offload as the FSDP2 trainer (trainers/offload.py) --------
    def offload(self) -> dict[str, float]:
        return self.memory.offload()

    def reload(self) -> dict[str, float]:
        return self.memory.reload()

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        if self._owns_group and dist.is_initialized():
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            self._owns_group = False
