"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2) <-> Megatron-core with multi-latent attention (MLA).

Attention, HF checkpoint name -> Megatron-core local MLA spec name (inside ``model.layers.N.self_attn`` /
``decoder.layers.N.self_attention``):
- ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj`` ->
  ``linear_q_up_proj`` (``q_lora_rank`` set), or ``q_proj`` -> ``linear_q_proj`` (``q_lora_rank: null``,
  e.g. DeepSeek-V2-Lite);
- ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj`` (rows: the ``kv_lora_rank`` latent, then the shared
  rope key),
  ``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` -> ``linear_kv_up_proj`` (per head: nope key, value);
- ``o_proj`` -> ``linear_proj``.
Each query head's rows are [nope, rope] in both. Rope layout: DeepSeek checkpoints (HF ``rope_interleave:
true``, the default) rotate interleaved pairs (x0, x1), (x2, x3), ..., and so does Megatron's MLA: with
``multi_latent_attention`` its rope (unfused and fused) first de-interleaves the rope dims to
[even, odd] and then rotates halves, with ``rotary_interleaved=False``, exactly what HF's interleaved rope
computes. So those rows are copied as they are. A checkpoint with ``rope_interleave: false`` rotates halves
directly; its rope rows are permuted to the interleaved order on the way in (row i -> 2i, row i + d/2 -> 2i+1)
and back on the way out, bit for bit.

The MoE block (sigmoid router with expert bias, shared experts, dense layers first) is in arch_moe.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from miles_agent.errors import UserError
from miles_agent.trainers.megatron import arch_moe
from miles_agent.trainers.megatron.arch_spec import ArchSpec, MLASpec, rope_theta

ARCH = "DeepseekV3ForCausalLM"
# yarn keys of the HF rope parameters -> Megatron MLATransformerConfig fields
_YARN = {"factor": "rotary_scaling_factor",
         **{k: k for k in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                           "mscale_all_dim")}}


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return {}
    if kind != "yarn":
        raise UserError(f"{ARCH}: rope type {kind!r} is not supported by the Megatron converter "
                        "(default or yarn)")
    return {k: params[k] for k in _YARN if params.get(k) is not None}


def spec(cfg: Any) -> ArchSpec:
    if getattr(cfg, "attention_bias", False):
        raise UserError(f"{ARCH}: attention_bias=true is not supported (Megatron's MLA projections "
                        "have no bias)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UserError(f"{ARCH}: hidden_act={cfg.hidden_act!r} is not supported (only silu)")
    heads = cfg.num_attention_heads
    mla = MLASpec(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                  qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                  v_head_dim=cfg.v_head_dim,
                  rope_interleaved=bool(getattr(cfg, "rope_interleave", True)),
                  rope_scaling=tuple(sorted(_rope_parameters(cfg).items())))
    return ArchSpec(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=heads, num_kv_heads=heads,
        head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, tied_embeddings=bool(cfg.tie_word_embeddings), rope_theta=rope_theta(cfg),
        norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        family="deepseek_v3", qk_norm=True, mla=mla, **arch_moe.moe_fields(cfg, ARCH))


def megatron_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """MLATransformerConfig fields."""
    m = spec.mla
    assert m is not None
    yarn = dict(m.rope_scaling)
    kw: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        rotary_base=spec.rope_theta, rotary_interleaved=False,  # MLA de-interleaves itself: module docstring
        rope_type="yarn" if yarn else "rope",
    )
    kw.update({_YARN[k]: v for k, v in yarn.items()})
    if not yarn:
        kw["rotary_scaling_factor"] = 1.0  # MLA's softmax scale uses it even for plain rope
    return kw


# -- names -------------------------------------------------------------------------------------------

_SIMPLE = {  # HF suffix -> Megatron suffix, inside model.layers.N / decoder.layers.N
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
}
# projections whose rope rows are permuted (the query projection has them per head)
_ROPE_ROWS = {
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
}


def _attention_hf_names(prefix: str, spec: ArchSpec) -> set[str]:
    m = spec.mla
    assert m is not None
    q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if m.q_lora_rank is not None else ("q_proj",)
    attn = (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    names = {f"{prefix}self_attn.{n}.weight" for n in attn}
    return names | {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}


def _rope_perm(spec: ArchSpec, hf_name: str, inverse: bool) -> Tensor | None:
    """Row order taking HF's rows to Megatron's (or back) for a projection with rope rows."""
    m = spec.mla
    assert m is not None
    if m.rope_interleaved:
        return None
    d = m.qk_rope_head_dim
    to_hf = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # Megatron row 2i <- HF row i, ...
    rope = to_hf if inverse else torch.argsort(to_hf)
    if hf_name == "self_attn.kv_a_proj_with_mqa.weight":  # [latent, rope key]
        return torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + rope])
    head = m.qk_nope_head_dim + d  # [nope, rope] per query head
    one = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + rope])
    return torch.cat([h * head + one for h in range(spec.num_heads)])


def _permuted(t: Tensor, perm: Tensor | None) -> Tensor:
    return t if perm is None else t.index_select(0, perm)


def hf_to_megatron(hf: Mapping[str, Tensor], spec: ArchSpec, vocab_size: int | None = None
                   ) -> dict[str, Tensor]:
    out = arch_moe.check_and_convert_outer(hf, spec, vocab_size, _attention_hf_names, ARCH)
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _SIMPLE.items():
            if src + h in hf:
                out[dst + m] = hf[src + h]
        for h, m in _ROPE_ROWS.items():
            if src + h in hf:
                out[dst + m] = _permuted(hf[src + h], _rope_perm(spec, h, inverse=False))
        out.update(arch_moe.mlp_to_megatron(hf, src, dst, spec, i))
    return out


def megatron_to_hf(mc: Mapping[str, Tensor], spec: ArchSpec) -> dict[str, Tensor]:
    simple = {m: h for h, m in _SIMPLE.items()}
    rope_rows = {m: h for h, m in _ROPE_ROWS.items()}
    out = arch_moe.outer_to_hf(mc, spec)
    layer = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
    for name, t in mc.items():
        if name.endswith("_extra_state") or name in arch_moe.OUTER_MEGATRON:
            continue
        m = layer.fullmatch(name)
        if not m:
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {ARCH} converter")
        rest, dst = m.group(2), f"model.layers.{m.group(1)}."
        if rest in simple:
            out[dst + simple[rest]] = t
        elif rest in rope_rows:
            out[dst + rope_rows[rest]] = _permuted(t, _rope_perm(spec, rope_rows[rest], inverse=True))
        elif (mlp := arch_moe.mlp_to_hf(rest, t, dst)) is not None:
            out.update(mlp)
        else:
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in the {ARCH} converter")
    return out


# -- the local (non-Transformer-Engine) MLA layer spec --------------------------------------------------

def use_local_mla_attention(layer_specs: list[Any]) -> None:
    """Megatron-core's local MLA layer spec, with a core attention that accepts MLA's head sizes.

    MLA's queries/keys (nope + rope dims) and values (v_head_dim) have different head sizes, and
    MLASelfAttention passes them as ``k_channels`` / ``v_channels``. Only TE's attention takes those;
    the local ``DotProductAttention`` (megatron-core 0.16) does not, although its math already handles
    unequal sizes except for the width of its output. The subclass below adds exactly that.

    Without Transformer Engine installed, megatron-core 0.16's MLA module still believes TE is there
    (its TE-extension import succeeds, with a mock standing in for ``TELinear``) and then calls
    ``isinstance(x, <mock>)``; it is told the truth here."""
    from megatron.core.transformer import multi_latent_attention as mla_module

    if not isinstance(getattr(mla_module, "TELinear", None), type):
        mla_module.HAVE_TE = False
    for layer_spec in layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = _mla_dot_product_attention()


_MLA_ATTENTION: Any = None


def _mla_dot_product_attention() -> Any:
    global _MLA_ATTENTION
    if _MLA_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLADotProductAttention(DotProductAttention):
            def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                         **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if v_channels is not None:  # the context is per-head values: heads x v_head_dim
                    self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

        _MLA_ATTENTION = MLADotProductAttention
    return _MLA_ATTENTION
