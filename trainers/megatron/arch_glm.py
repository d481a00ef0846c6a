"""Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air) <-> Megatron-core.

Attention is grouped-query attention as in Qwen3, fused into ``linear_qkv`` the same way (bridge.fuse_qkv),
plus what GLM adds: biases on q/k/v (``attention_bias``; fused into ``linear_qkv.bias`` in the same group
order), an optional per-head QK RMSNorm (``use_qk_norm``: GLM-4.5-Air has none), and partial rotary
embeddings (``partial_rotary_factor`` 0.5: the first half of each head's dims are rotated, halves layout,
which is Megatron's ``rotary_percent``). The MoE block (sigmoid router with expert bias, shared experts, dense
layers first) is in arch_moe.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from miles_agent.errors import UserError
from miles_agent.trainers.megatron import arch_moe
from miles_agent.trainers.megatron.arch_spec import ArchSpec, fuse_qkv, rope_theta, split_qkv

ARCH = "Glm4MoeForCausalLM"


def _partial_rotary_factor(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    kind = params.get("rope_type", "default")
    if kind not in ("default", None):
        raise UserError(f"{ARCH}: rope type {kind!r} is not supported by the Megatron converter "
                        "(default only)")
    return float(factor)


def spec(cfg: Any) -> ArchSpec:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UserError(f"{ARCH}: hidden_act={cfg.hidden_act!r} is not supported (only silu)")
    heads = cfg.num_attention_heads
    return ArchSpec(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        tied_embeddings=bool(cfg.tie_word_embeddings), rope_theta=rope_theta(cfg), norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, family="glm4_moe",
        qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        qk_norm=bool(getattr(cfg, "use_qk_norm", False)),
        rotary_percent=_partial_rotary_factor(cfg), **arch_moe.moe_fields(cfg, ARCH))


_SIMPLE = {  # HF suffix -> Megatron suffix, inside model.layers.N / decoder.layers.N
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def _attention_hf_names(p: str, spec: ArchSpec) -> set[str]:
    names = {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                             "self_attn.o_proj.weight")}
    names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkv"}
    if spec.qkv_bias:
        names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
    if spec.qk_norm:
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def hf_to_megatron(hf: Mapping[str, Tensor], spec: ArchSpec, vocab_size: int | None = None
                   ) -> dict[str, Tensor]:
    out = arch_moe.check_and_convert_outer(hf, spec, vocab_size, _attention_hf_names, ARCH)
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[src + "q_proj.weight"], hf[src + "k_proj.weight"], hf[src + "v_proj.weight"], spec)
        if spec.qkv_bias:  # a bias is a one-column weight for the fusion
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(hf[f"{src}{x}_proj.bias"].unsqueeze(-1) for x in "qkv"), spec).squeeze(-1)
        layer = f"model.layers.{i}."
        for h, m in _SIMPLE.items():
            if layer + h in hf:
                out[dst + m] = hf[layer + h]
        out.update(arch_moe.mlp_to_megatron(hf, layer, dst, spec, i))
    return out


def megatron_to_hf(mc: Mapping[str, Tensor], spec: ArchSpec) -> dict[str, Tensor]:
    simple = {m: h for h, m in _SIMPLE.items()}
    out = arch_moe.outer_to_hf(mc, spec)
    layer = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
    for name, t in mc.items():
        if name.endswith("_extra_state") or name in arch_moe.OUTER_MEGATRON:
            continue
        m = layer.fullmatch(name)
        if not m:
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {ARCH} converter")
        rest, dst = m.group(2), f"model.layers.{m.group(1)}."
        if rest == "self_attention.linear_qkv.weight":
            q, k, v = split_qkv(t, spec)
            out.update({f"{dst}self_attn.{x}_proj.weight": w for x, w in zip("qkv", (q, k, v))})
        elif rest == "self_attention.linear_qkv.bias":
            q, k, v = split_qkv(t.unsqueeze(-1), spec)
            out.update({f"{dst}self_attn.{x}_proj.bias": b.squeeze(-1) for x, b in zip("qkv", (q, k, v))})
        elif rest in simple:
            out[dst + simple[rest]] = t
        elif (mlp := arch_moe.mlp_to_hf(rest, t, dst)) is not None:
            out.update(mlp)
        else:
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {ARCH} converter")
    return out
