"""The Megatron-core trainer backend: same contract and the same losses as the FSDP2 trainer.

The policy arrives as an HF model (what ``load_policy`` builds); its weights are converted once into
this rank's shard of a Megatron GPTModel (bridge.py, sharding.py). The step is the FSDP2 trainer's
(``policy_trainer.PolicyTrainer``): this backend supplies logprobs from Megatron's vocab-parallel cross
entropy, gradient completion and the sharded norm -- so an algorithm never knows the backend.
Weights leave in the engine's HF names (``named_weights``), so every weight-sync transport works.

Parallelism: tensor, expert, data and pipeline parallel (Megatron's 1F1B schedule, ``pipeline.py``);
context parallel is refused. Gradients are completed as Megatron's ``finalize_model_grads`` does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_agent.algorithms.estimators import needs_reference
from miles_agent.atomic import replace_dir
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError, require
from miles_agent.trainers.batching import MicroBatch
from miles_agent.trainers.fsdp2 import init_distributed
from miles_agent.trainers.megatron import bridge
from miles_agent.trainers.megatron.model import ParallelSizes, build_gpt, padded_vocab
from miles_agent.trainers.megatron.options import MegatronConfig
from miles_agent.trainers.megatron.sharding import RankCoords, merge, shard
from miles_agent.trainers.policy_trainer import OptimizerStep, PolicyTrainer
from miles_agent.trainers.precision import MainParams, dtypes
from miles_agent.trainers.step_loss import micro_batch_loss


class MegatronTrainer(PolicyTrainer):
    """Algorithm-blind policy trainer on Megatron-core (the step is ``PolicyTrainer``'s; these are its hooks)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, train: TrainConfig, algo: AlgoConfig, *,
                 temperature: float = 1.0, device: str = "cpu", megatron: MegatronConfig | None = None,
                 lora: Any = None) -> None:
        require("megatron.core", "megatron", "the Megatron-core trainer backend")
        if lora is not None and lora.enabled:  # megatron-core ships no LoRA; its PEFT lives in Megatron-Bridge
            raise UserError("lora.rank > 0 with train.backend=megatron needs Megatron-Bridge's PEFT "
                            "(megatron.bridge.peft), which is not installed; use train.backend=fsdp2 for LoRA")
        from megatron.core import parallel_state as ps

        super().__init__(tokenizer, train, algo, temperature)
        if train.pack_sequences is True:  # auto: off here
            raise UserError("train.pack_sequences is implemented by the fsdp2 trainer only; set "
                            "train.pack_sequences=false (or auto) with train.backend=megatron")
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
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._owns_group = init_distributed(self.device, train.world_size)  # the FSDP2 backend's join-or-create
        self.rank = dist.get_rank()
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
        dtype, master = dtypes(model, train)  # bf16 parameters, fp32 main copies (precision.MainParams)
        full = bridge.hf_to_megatron(bridge.hf_checkpoint_tensors(model), self.spec,
                                     padded_vocab(self.spec, self.sizes.tensor))
        local = shard(full, self.spec, self.sizes, self.coords)
        del full
        self.model = self._build_loaded(local, dtype)
        self.ref_model: torch.nn.Module | None = None
        if needs_reference(algo):  # a frozen copy of the initial policy, sharded the same way (not saved)
            self.ref_model = self._build_loaded(local, dtype).requires_grad_(False).eval()
        del local
        self.compute_dtype = dtype
        self.main = MainParams(self.model, master) if master != dtype else None
        self._init_optimizer()

    def _build_loaded(self, local: dict[str, Tensor], dtype: torch.dtype) -> torch.nn.Module:
        """This rank's GPTModel holding ``local`` (its shard of the converted weights)."""
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if self.train_cfg.activation_checkpointing else {}
        gpt = build_gpt(self.spec, self.sizes, dtype, **recompute).to(self.device)
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

    def _forward_logprobs(self, model: torch.nn.Module, mb: MicroBatch, entropy: bool = False,
                          entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
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

    @torch.no_grad()
    def _no_grad_logprobs(self, model: torch.nn.Module, mbs: Sequence[MicroBatch]) -> list[Tensor]:
        """Every micro-batch's logprobs, on every rank (pipeline: computed on the last stage, broadcast)."""
        if self.sizes.pipeline == 1:
            return super()._no_grad_logprobs(model, mbs)
        model.eval()
        from miles_agent.trainers.megatron import pipeline

        def loss_func(mb: MicroBatch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logp = self._logits_logp(output, mb)[0]
            return logp.sum() * 0.0, {"logp": logp}

        outs = pipeline.run(model, mbs, self._forward, loss_func, forward_only=True)
        return pipeline.from_last_stage([o["logp"] for o in outs] if outs else None,
                                        [mb.targets.shape for mb in mbs], self.device)

    # -- hooks: backward, gradients, metrics ------------------------------------------------------
    def _backward(self, loss: Tensor) -> None:
        loss.backward()  # each data-parallel rank's loss is its share of the global sum (_reduce_grads)

    def _backward_micro_batches(self, step: OptimizerStep, measure: bool) -> Iterator[dict[str, Tensor]]:
        """With pipeline parallelism: Megatron's 1F1B schedule, the metrics on the last stage only."""
        if self.sizes.pipeline == 1:
            yield from super()._backward_micro_batches(step, measure)
            return
        from miles_agent.trainers.megatron import pipeline

        entropy_grad, norm = self.algo.entropy_coef != 0, step.norm
        extra = {id(mb): (old, ref) for mb, old, ref in zip(step.micro_batches, step.olds, step.refs)}

        def loss_func(mb: MicroBatch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logp, entropy = self._logits_logp(output, mb, entropy=True, entropy_grad=entropy_grad)
            return micro_batch_loss(self.algo, self._loss_opts, logp, entropy, mb, *extra[id(mb)], norm,
                                    measure)

        yield from pipeline.run(self.model, step.micro_batches, self._forward, loss_func, forward_only=False)

    def _reduce_grads(self) -> None:
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
            shared = getattr(shared, "main_copy", shared)
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())
        for name, p, g in self._grad_holders():
            if g.grad is None:
                g.grad = torch.zeros_like(g)
            if self.sizes.tensor > 1:
                if getattr(p, "average_gradients_across_tp_domain", False):
                    dist.all_reduce(g.grad, op=dist.ReduceOp.AVG, group=tp_group)
                elif "q_layernorm" in name or "k_layernorm" in name or (
                        seq_parallel and getattr(p, "sequence_parallel", False)):
                    dist.all_reduce(g.grad, group=tp_group)
            group = experts if ".local_experts." in name else dense
            if dist.get_world_size(group) > 1:
                dist.all_reduce(g.grad, group=group)

    def _grad_holders(self) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]]:
        """(name, model parameter, the parameter holding its gradient): the fp32 main copy under mixed
        precision (gradients are accumulated there in fp32), else the parameter itself."""
        if self.main is not None:
            return list(self.main.named())
        return [(n, p, p) for n, p in self.model.named_parameters()]

    def _optimized_params(self) -> list[torch.nn.Parameter]:
        return self.main.params() if self.main is not None else super()._optimized_params()

    def _optimizer_step(self) -> float:
        grad_norm = super()._optimizer_step()
        if self.main is not None:
            self.main.to_model()  # the stepped fp32 weights, rounded into the bf16 model
        return grad_norm

    def _grad_norm(self) -> Tensor:
        """The global norm over the model-parallel shards: dense weights are distinct over the tensor x
        pipeline ranks (TP-replicated ones counted once), experts over expert-tensor x expert x pipeline."""
        from megatron.core import parallel_state as ps

        dense, experts = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for name, p, g in self._grad_holders():
            if g.grad is None:
                continue
            if getattr(p, "shared", False):
                continue  # the last stage's copy of tied embeddings: counted on the first stage
            if ".local_experts." in name:
                experts += g.grad.float().pow(2).sum()
            elif getattr(p, "tensor_model_parallel", False) or self.coords.tensor == 0:
                dense += g.grad.float().pow(2).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
            if self.spec.is_moe:
                dist.all_reduce(experts, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return (dense + experts).sqrt()

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _sum_metric_shares(self, sums: dict[str, Tensor]) -> tuple[dict[str, float], float]:
        """Tensor-parallel ranks hold the same values (summed over data-parallel ranks only); with
        pipeline parallelism the losses ran on the last stage, which sends them to every stage."""
        values, mx = super()._sum_metric_shares(sums)
        if self.sizes.pipeline > 1:
            from miles_agent.trainers.megatron import pipeline

            values, mx = pipeline.object_from_last_stage((values, mx))
        return values, mx

    # -- weights out --------------------------------------------------------------------------------
    def _full_hf_state(self) -> dict[str, Tensor]:
        """Every rank's shard gathered and merged, in HF checkpoint names and the compute dtype (the
        engine's; Megatron's CPU norms hold fp32 weights in a bf16 model). A collective."""
        local = {k: v.detach().cpu().to(self.compute_dtype) if v.is_floating_point() else v.detach().cpu()
                 for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
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
                    "main": None if self.main is None else self.main.state_dict(),  # the fp32 masters
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
        if self.main is not None:
            if state.get("main") is None:
                raise UserError(f"checkpoint {path} holds no fp32 main weights (written with train.master_dtype "
                                "equal to model.dtype); resume with the same precision settings")
            self.main.load_state_dict(state["main"])
        self.optimizer.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        self.step = int(meta["step"])

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        if self._owns_group and dist.is_initialized():
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            self._owns_group = False
