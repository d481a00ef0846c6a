"""Build a Megatron-core GPTModel from an HF config (through the architecture spec in bridge.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles_agent.errors import UserError, require
from miles_agent.trainers.megatron.arch_spec import ArchSpec


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1
    expert_tensor: int = 1
    # Uneven pipelines (e.g. 61 layers): the first / last stage hold these many layers, the middle
    # stages split the rest evenly (Megatron's num_layers_in_first/last_pipeline_stage).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def stage_sizes(self, num_layers: int) -> list[int] | None:
        """Layers per pipeline stage, or None when they cannot be laid out."""
        pp = self.pipeline
        first, last = self.first_stage_layers, self.last_stage_layers
        if pp == 1:
            return None if (first or last) else [num_layers]
        ends = [x for x in (first, last) if x is not None]
        middle_stages = pp - len(ends)
        rest = num_layers - sum(ends)
        if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and rest % middle_stages):
            return None
        per = rest // middle_stages if middle_stages else 0
        sizes = [per] * pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def check(self, spec: ArchSpec, world_size: int | None = None) -> None:
        """Every parallel size must divide the dimension it splits; a clear error names which does not."""
        problems = []
        tp = self.tensor
        for what, n in (("attention heads", spec.num_heads), ("KV heads (query groups)", spec.num_kv_heads),
                        ("FFN hidden size", spec.ffn_hidden_size)):
            if n % tp:
                problems.append(f"tensor_parallel={tp} does not divide the {what} ({n})")
        for what, n in _family_split_dims(spec):
            if n % tp:
                problems.append(f"tensor_parallel={tp} does not divide the {what} ({n})")
        if self.stage_sizes(spec.num_layers) is None:
            problems.append(f"pipeline_parallel={self.pipeline} (first stage {self.first_stage_layers}, last stage "
                            f"{self.last_stage_layers}) cannot lay out the {spec.num_layers} layers; set "
                            "megatron.first_stage_layers / last_stage_layers so the middle stages divide the rest")
        if spec.is_moe:
            if spec.num_experts % self.expert:
                problems.append(f"expert_parallel={self.expert} does not divide the {spec.num_experts} experts")
            if spec.moe_ffn_hidden_size % self.expert_tensor:
                problems.append(f"expert_tensor_parallel={self.expert_tensor} does not divide the expert FFN "
                                f"size ({spec.moe_ffn_hidden_size})")
        elif self.expert != 1:
            problems.append(f"expert_parallel={self.expert} needs an MoE model; this one is dense")
        if world_size is not None:
            model_parallel = tp * self.pipeline * self.context
            if world_size % model_parallel:
                problems.append(f"{world_size} GPUs are not a multiple of tensor*pipeline*context = "
                                f"{model_parallel}")
            elif spec.is_moe and (world_size // self.pipeline) % (self.expert * self.expert_tensor):
                # MoE parallel folding: expert ranks are laid over the tp*dp*cp ranks of each stage.
                problems.append(f"expert_parallel*expert_tensor_parallel={self.expert * self.expert_tensor} "
                                f"must divide the {world_size // self.pipeline} ranks of a pipeline stage")
        if problems:
            raise UserError("invalid Megatron parallel sizes: " + "; ".join(problems))


def _family_split_dims(spec: ArchSpec) -> list[tuple[str, int]]:
    """Further dimensions tensor parallelism splits in the DeepSeek-V3 / GLM-4.5 families (the local MLA
    spec splits the latent down projections' outputs too, see sharding.py)."""
    dims = []
    if spec.shared_expert_ffn_hidden_size:
        dims.append(("shared-expert FFN size", spec.shared_expert_ffn_hidden_size))
    if spec.mla is not None:
        m = spec.mla
        dims.append(("KV down projection (kv_lora_rank + qk_rope_head_dim)",
                     m.kv_lora_rank + m.qk_rope_head_dim))
        if m.q_lora_rank is not None:
            dims.append(("q_lora_rank", m.q_lora_rank))
    return dims


def layout_spec(config: Mapping[str, Any]) -> ArchSpec:
    """The dimensions a parallel layout depends on, from any decoder's config.json (Qwen3, Qwen3-MoE,
    GLM-4.5, DeepSeek-V3/Kimi-K2 spell the expert fields differently). For checking layouts only: the
    weight converter dispatches on the architecture (bridge.arch_spec)."""
    def first(*keys: str, default: Any = None) -> Any:
        return next((config[k] for k in keys if config.get(k) is not None), default)

    layers = int(config["num_hidden_layers"])
    experts = int(first("num_experts", "n_routed_experts", "num_local_experts", default=0))
    dense_first = int(first("first_k_dense_replace", default=0))
    heads = int(config["num_attention_heads"])
    return ArchSpec(
        num_layers=layers, hidden_size=int(config["hidden_size"]), num_heads=heads,
        num_kv_heads=int(first("num_key_value_heads", default=heads)),
        head_dim=int(first("head_dim", default=int(config["hidden_size"]) // heads)),
        ffn_hidden_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), rope_theta=0.0, norm_eps=0.0,
        max_position_embeddings=0, num_experts=experts, moe_topk=int(first("num_experts_per_tok", default=0)),
        moe_ffn_hidden_size=int(first("moe_intermediate_size", default=0)),
        moe_layers=tuple(range(dense_first, layers)) if experts else ())


def padded_vocab(spec: ArchSpec, tensor_parallel: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary across TP ranks: pad it to a multiple of 128 * TP, like Megatron-LM."""
    step = multiple * tensor_parallel
    return -(-spec.vocab_size // step) * step


def transformer_config(spec: ArchSpec, sizes: ParallelSizes, dtype: torch.dtype = torch.float32,
                       **overrides: Any) -> Any:
    require("megatron.core", "megatron", "the Megatron-core trainer backend")
    from megatron.core.transformer.transformer_config import TransformerConfig

    # alltoall is the fast MoE path with expert parallelism; it needs CUDA streams, so CPU uses allgather
    # (same numbers, different communication). A dense model has no dispatcher: alltoall is only a setting.
    dispatcher = "alltoall" if torch.cuda.is_available() or not spec.is_moe else "allgather"
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=sizes.tensor, pipeline_model_parallel_size=sizes.pipeline,
        num_layers_in_first_pipeline_stage=sizes.first_stage_layers,
        num_layers_in_last_pipeline_stage=sizes.last_stage_layers,
        context_parallel_size=sizes.context,
        # sequence parallelism needs the fused TE/Apex norms; torch norms (CPU) run without it
        sequence_parallel=sizes.tensor > 1 and _has_te(),
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        # packed micro-batches differ in length: pipeline stages exchange activation shapes first (the
        # allgather dispatcher cannot; the trainer refuses MoE pipelines on CPU, the model still builds)
        variable_seq_lengths=sizes.pipeline > 1 and dispatcher != "allgather",
        moe_token_dispatcher_type=dispatcher,
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size, expert_model_parallel_size=sizes.expert,
            expert_tensor_parallel_size=sizes.expert_tensor,
            # Qwen3-MoE: softmax over all experts, top-k, then renormalize when norm_topk_prob. Megatron's
            # default (top-k on logits, softmax over the k) is the same function; pre-softmax is the
            # no-renormalization variant.
            moe_router_pre_softmax=not spec.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_layer_freq=[int(i in spec.moe_layers) for i in range(spec.num_layers)],
            moe_grouped_gemm=False,
        )
    kw.update(qk_layernorm=spec.qk_norm, add_qkv_bias=spec.qkv_bias, **_family_kwargs(spec))
    kw.update(overrides)
    if spec.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def _family_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """TransformerConfig fields of the DeepSeek-V3 / GLM-4.5 families (sigmoid router, shared experts,
    MLA)."""
    from miles_agent.trainers.megatron import arch_deepseek, arch_moe

    kw = arch_moe.megatron_kwargs(spec) if spec.is_moe else {}
    if spec.mla is not None:
        kw.update(arch_deepseek.megatron_kwargs(spec))
    return kw


def build_gpt(spec: ArchSpec, sizes: ParallelSizes, dtype: torch.dtype = torch.float32, *,
              use_te: bool | None = None, **overrides: Any) -> Any:
    """A GPTModel for this rank of an initialized Megatron parallel state (local layers unless TE is
    installed and wanted; the weight names differ only in where the pre-norms live)."""
    require("megatron.core", "megatron", "the Megatron-core trainer backend")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    config = transformer_config(spec, sizes, dtype, **overrides)
    if use_te is None:
        use_te = torch.cuda.is_available() and _has_te()
    if use_te:
        raise UserError("the Transformer Engine layer spec is not wired into the converter yet; "
                        "set megatron.use_te=false")
    num_experts = spec.num_experts if spec.is_moe else None
    if spec.family == "qwen3":
        layer_spec = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                    qk_layernorm=True, normalization="RMSNorm")
    else:  # dense layers first, then MoE ones: one local spec per layer of this stage, from moe_layer_freq
        layer_spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                      normalization="RMSNorm")
    if spec.mla is not None:
        from miles_agent.trainers.megatron import arch_deepseek

        arch_deepseek.use_local_mla_attention(layer_spec.layer_specs)
    from megatron.core import parallel_state as ps

    return GPTModel(config=config, transformer_layer_spec=layer_spec,
                    vocab_size=padded_vocab(spec, sizes.tensor), max_sequence_length=spec.max_position_embeddings,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    position_embedding_type="rope", rotary_base=int(spec.rope_theta),
                    rotary_percent=spec.rotary_percent,
                    share_embeddings_and_output_weights=spec.tied_embeddings)


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
