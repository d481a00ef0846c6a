"""Per-GPU memory of a training layout, from a model's config.json alone (nothing is built or loaded).

Parameters are counted tensor by tensor from the architecture (dense or MoE, GQA or DeepSeek's MLA), then
split the way each backend stores them:

* FSDP2 with bf16 compute over fp32 master weights: fp32 parameters, fp32 gradients and Adam's two fp32
  moments are sharded over every rank (16 bytes / world size per parameter); the bf16 copy of the layers
  being computed is gathered two at a time (one computing, one prefetched).
* Megatron-core: bf16 parameters and fp32 gradient buffers are local to the rank's shard (dense weights
  over TP x PP, experts over EP x expert-TP x PP), and so are the trainer's fp32 main parameters and Adam
  moments (18 bytes per parameter on the rank): trainers/precision.py keeps them whole on every data-parallel
  rank, since megatron-core's distributed optimizer (6 + 12 / DP) takes CUDA tensors only.

Activations are what backward keeps per token (bf16), at ``train.micro_batch_tokens`` per micro-batch: every
layer's tensors without activation checkpointing, or each layer's input plus one layer recomputed with it.
Logits are counted separately (fp32 ``[T, V]`` unless logprobs are computed in chunks). KV cache is SGLang's
layout: ``2 x kv_heads x head_dim`` per layer and token (split over TP when the heads are), or MLA's
compressed ``kv_lora_rank + qk_rope_head_dim``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = float(1 << 30)
BF16 = 2


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions memory depends on, and the parameter counts by where they live."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int  # dense MLP width
    experts: int  # routed experts per MoE layer (0 = dense)
    topk: int
    moe_ffn: int
    shared_experts: int
    moe_layers: int
    mla: dict[str, int]  # q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim ({} = GQA)
    attn_params: int  # per layer, norms included
    dense_mlp_params: int  # per dense layer
    expert_params: int  # one routed expert
    moe_shared_params: int  # per MoE layer: router and shared experts
    embed_params: int  # input embedding and, untied, the output head

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def routed_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def total_params(self) -> int:
        return (self.layers * self.attn_params + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * self.moe_shared_params + self.routed_params + self.embed_params + self.hidden)

    @property
    def active_params(self) -> int:
        return self.total_params - self.moe_layers * (self.experts - self.topk) * self.expert_params

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """One token's KV cache on one engine GPU (bf16)."""
        if self.mla:  # compressed latent and the shared rope key, replicated on every TP rank
            return self.layers * (self.mla["kv_lora_rank"] + self.mla["qk_rope_head_dim"]) * BF16
        kv_heads = max(1, self.kv_heads // tp) if self.kv_heads >= tp else 1
        return self.layers * 2 * kv_heads * self.head_dim * BF16

    def activation_bytes_per_token_layer(self) -> int:
        """bf16 tensors backward keeps for one token in one layer (flash attention: no [T, T] scores)."""
        h = self.hidden
        if self.mla:
            m = self.mla
            q_dim = self.heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"])
            attn = (m["q_lora_rank"] + q_dim + m["kv_lora_rank"] + m["qk_rope_head_dim"]
                    + self.heads * (m["qk_nope_head_dim"] + m["v_head_dim"]) + self.heads * m["v_head_dim"])
        else:
            attn = (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim
        norms_and_residuals = 4 * h  # both norms' inputs and outputs
        if self.moe_layers:  # a layer's worst case: each token in topk experts plus the shared ones
            mlp = self.topk * (h + 4 * self.moe_ffn) + self.shared_experts * 4 * self.moe_ffn + 2 * self.experts
        else:
            mlp = 4 * self.ffn  # gate and up outputs, the activation and its product
        return (norms_and_residuals + attn + mlp) * BF16


def model_shape(cfg: Mapping[str, Any]) -> ModelShape:
    """Counts from a config.json (Qwen3 / Qwen3-MoE / GLM-4.5 / DeepSeek-V3 / Kimi-K2 / Llama-style keys)."""
    layers, h = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    d = int(_first(cfg, "head_dim", default=h // heads))
    vocab = int(cfg["vocab_size"])
    experts = int(_first(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=0))
    moe_ffn = int(_first(cfg, "moe_intermediate_size", default=0))
    ffn = int(_first(cfg, "intermediate_size", default=4 * h))
    shared = int(_first(cfg, "n_shared_experts", default=0))
    moe_layers = layers - int(_first(cfg, "first_k_dense_replace", default=0)) if experts else 0
    mla: dict[str, int] = {}
    if cfg.get("kv_lora_rank"):
        mla = {k: int(cfg.get(k) or 0) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                 "qk_rope_head_dim", "v_head_dim")}
        q_dim = heads * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"])
        q = h * mla["q_lora_rank"] + mla["q_lora_rank"] + mla["q_lora_rank"] * q_dim if mla["q_lora_rank"] else h * q_dim
        kv = (h * (mla["kv_lora_rank"] + mla["qk_rope_head_dim"]) + mla["kv_lora_rank"]
              + mla["kv_lora_rank"] * heads * (mla["qk_nope_head_dim"] + mla["v_head_dim"]))
        attn = q + kv + heads * mla["v_head_dim"] * h
    else:
        attn = h * (heads + 2 * kv_heads) * d + heads * d * h
        if cfg.get("attention_bias"):
            attn += (heads + 2 * kv_heads) * d
        if cfg.get("model_type", "").startswith("qwen3") or cfg.get("use_qk_norm"):
            attn += 2 * d  # q_norm, k_norm
    attn += 2 * h  # input and post-attention norms
    router = experts * h + (experts if cfg.get("topk_method") == "noaux_tc" or "n_group" in cfg
                            or cfg.get("model_type") == "glm4_moe" else 0)  # + expert score bias
    untied = not cfg.get("tie_word_embeddings", False)
    return ModelShape(
        layers=layers, hidden=h, heads=heads, kv_heads=kv_heads, head_dim=d, vocab=vocab, ffn=ffn,
        experts=experts, topk=int(_first(cfg, "num_experts_per_tok", default=0)), moe_ffn=moe_ffn,
        shared_experts=shared, moe_layers=moe_layers, mla=mla, attn_params=attn, dense_mlp_params=3 * h * ffn,
        expert_params=3 * h * moe_ffn, moe_shared_params=router + shared * 3 * h * moe_ffn,
        embed_params=vocab * h * (2 if untied else 1))


@dataclass(frozen=True)
class Sharding:
    """How one trainer rank holds the model: FSDP2 (``world`` ranks) or Megatron's sizes."""

    backend: str  # fsdp2 | megatron
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.pp * self.cp))


@dataclass(frozen=True)
class TrainMemory:
    """One trainer GPU's bytes, by kind."""

    params_on_rank: float  # parameters this rank owns (counted, not bytes)
    weights: float
    gradients: float
    optimizer: float  # fp32 master weights + Adam moments
    activations: float  # without activation checkpointing
    activations_checkpointed: float
    logits: float  # fp32 [T, V / TP] of one micro-batch, unchunked

    def total(self, checkpointing: bool, chunked_logits: bool = False) -> float:
        act = self.activations_checkpointed if checkpointing else self.activations
        return self.weights + self.gradients + self.optimizer + act + (0.0 if chunked_logits else self.logits)


def params_on_rank(shape: ModelShape, s: Sharding) -> float:
    """Parameters one rank holds: FSDP2 shards everything over every rank; Megatron splits dense weights
    over TP x PP and routed experts over EP x expert-TP x PP (the vocabulary over TP, on the end stages)."""
    if s.backend != "megatron":
        return shape.total_params / s.world
    dense = shape.total_params - shape.routed_params - shape.embed_params
    return dense / (s.tp * s.pp) + shape.routed_params / (s.ep * s.etp * s.pp) + shape.embed_params / s.tp


def train_memory(shape: ModelShape, s: Sharding, micro_batch_tokens: int) -> TrainMemory:
    n = params_on_rank(shape, s)
    tokens = micro_batch_tokens / s.cp
    per_layer = shape.activation_bytes_per_token_layer() * tokens
    if s.backend == "megatron":
        # bf16 params, fp32 grad buffer, fp32 main params + Adam moments. The trainer keeps its main params
        # whole on every data-parallel rank (trainers/precision.py: megatron-core's distributed optimizer
        # takes CUDA tensors only), so they are not divided over DP (no ZeRO-1 yet).
        weights, grads, optim = BF16 * n, 4 * n, 12 * n
        # Sequence parallel splits every layer's activations over TP. 1F1B keeps PP micro-batches in flight on
        # the first stage, each through layers / PP layers: layers' worth in all.
        act = shape.layers * per_layer / s.tp
        act_ckpt = (shape.layers * tokens * shape.hidden * BF16 + per_layer) / s.tp
        vocab = shape.vocab / s.tp
    else:
        gathered = 2 * (shape.attn_params + max(shape.dense_mlp_params, shape.moe_shared_params + shape.routed_params
                                                / max(1, shape.moe_layers)))  # two layers' bf16 weights
        weights, grads, optim = 4 * n + BF16 * gathered, 4 * n, 8 * n
        act = shape.layers * per_layer
        act_ckpt = shape.layers * tokens * shape.hidden * BF16 + per_layer
        vocab = shape.vocab
    return TrainMemory(n, weights, grads, optim, act, act_ckpt, logits=4.0 * tokens * vocab)


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU: weights of its TP share, and the KV cache left in its memory budget."""

    weights: float
    budget: float  # what the engine may use on this GPU (SGLang: mem_fraction_static x memory)
    kv_bytes_per_token: int

    @property
    def kv_cache(self) -> float:
        return self.budget - self.weights

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache // self.kv_bytes_per_token))


def engine_memory(shape: ModelShape, tp: int, budget_bytes: float) -> EngineMemory:
    return EngineMemory(weights=BF16 * shape.total_params / tp, budget=budget_bytes,
                        kv_bytes_per_token=shape.kv_bytes_per_token(tp))
