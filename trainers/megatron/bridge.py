"""HF <-> Megatron-core weight conversion, dispatched on the HF architecture.

Megatron keeps some HF tensors fused:
- ``linear_qkv`` holds Q, K and V interleaved by query group: for each KV head g, the rows of the
  query heads that share it, then K_g, then V_g. This is what lets tensor parallelism split the
  fused tensor by whole groups.
- ``linear_fc1`` holds the gated MLP's ``gate_proj`` rows, then its ``up_proj`` rows.
Everything here works on HF *checkpoint* names (what ``save_pretrained`` writes and the hub serves:
one tensor per expert), so a real checkpoint folder converts without loading a transformers model.

The conversion is a pure function of the tensors and the HF config; ``sharding.py`` splits the
Megatron names across tensor/pipeline/expert-parallel ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from miles_agent.errors import UserError
from miles_agent.trainers.megatron.arch_spec import ArchSpec, fuse_qkv, pad_rows, rope_theta, split_qkv


def _qwen3_spec(cfg: Any) -> ArchSpec:
    return ArchSpec(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        tied_embeddings=bool(cfg.tie_word_embeddings), rope_theta=rope_theta(cfg), norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings)


def _qwen3_moe_spec(cfg: Any) -> ArchSpec:
    dense = _qwen3_spec(cfg)
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    moe_layers = tuple(i for i in range(cfg.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0)
    return ArchSpec(**{**dense.__dict__, "num_experts": cfg.num_experts, "moe_topk": cfg.num_experts_per_tok,
                       "moe_ffn_hidden_size": cfg.moe_intermediate_size,
                       "norm_topk_prob": bool(cfg.norm_topk_prob), "moe_layers": moe_layers})


def _deepseek_v3_spec(cfg: Any) -> ArchSpec:
    from miles_agent.trainers.megatron import arch_deepseek

    return arch_deepseek.spec(cfg)


def _glm4_moe_spec(cfg: Any) -> ArchSpec:
    from miles_agent.trainers.megatron import arch_glm

    return arch_glm.spec(cfg)


# architecture name (config.architectures[0]) -> spec reader; the Qwen3 conversion rules are below,
# the other families' in their own modules (CONVERTERS).
ARCHITECTURES: dict[str, Callable[[Any], ArchSpec]] = {
    "Qwen3ForCausalLM": _qwen3_spec,
    "Qwen3MoeForCausalLM": _qwen3_moe_spec,
    "DeepseekV3ForCausalLM": _deepseek_v3_spec,  # DeepSeek-V3, Kimi-K2
    "Glm4MoeForCausalLM": _glm4_moe_spec,  # GLM-4.5, GLM-4.5-Air
}
CONVERTERS = {"deepseek_v3": "arch_deepseek", "glm4_moe": "arch_glm"}  # spec.family -> module


def _family(spec: ArchSpec) -> Any:
    import importlib

    return importlib.import_module(f"miles_agent.trainers.megatron.{CONVERTERS[spec.family]}")


def arch_spec(hf_config: Any) -> ArchSpec:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise UserError("the HF config has no `architectures` entry; the Megatron backend dispatches on it "
                        "(e.g. [\"Qwen3ForCausalLM\"]) -- add it to config.json")
    if archs[0] not in ARCHITECTURES:
        raise UserError(f"architecture {archs[0]!r} has no Megatron conversion yet; supported: "
                        f"{', '.join(ARCHITECTURES)}. Use train.backend=fsdp2 for it, or add a converter "
                        "in trainers/megatron/bridge.py")
    return ARCHITECTURES[archs[0]](hf_config)


# -- transformers' in-memory layout <-> checkpoint layout ----------------------------------------------

_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_checkpoint_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """A transformers model's weights under checkpoint names: transformers >= 5 keeps an MoE layer's
    experts fused in memory (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]),
    while checkpoints hold one tensor per expert."""
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        m = _FUSED_EXPERTS.fullmatch(name)
        if not m:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            prefix = f"{m.group(1)}.{e}."
            if m.group(2) == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
            else:
                out[prefix + "down_proj.weight"] = t[e]
    return out


def to_transformers_layout(hf: Mapping[str, Tensor], spec: ArchSpec) -> dict[str, Tensor]:
    """Checkpoint names -> the parameter names of a transformers model in memory (the engine's)."""
    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    for i in spec.moe_layers:
        ex = f"model.layers.{i}.mlp.experts."
        out[ex + "gate_up_proj"] = torch.stack([torch.cat([hf[f"{ex}{e}.gate_proj.weight"],
                                                           hf[f"{ex}{e}.up_proj.weight"]])
                                                for e in range(spec.num_experts)])
        out[ex + "down_proj"] = torch.stack([hf[f"{ex}{e}.down_proj.weight"] for e in range(spec.num_experts)])
    if spec.tied_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# -- names -------------------------------------------------------------------------------------------

_SIMPLE_LAYER = {  # HF suffix -> Megatron suffix, inside model.layers.N / decoder.layers.N
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
}


def hf_to_megatron(hf: Mapping[str, Tensor], spec: ArchSpec, vocab_size: int | None = None
                   ) -> dict[str, Tensor]:
    """HF checkpoint tensors -> Megatron GPTModel tensors (local layer spec names, SequentialMLP experts).

    ``vocab_size`` pads the embedding and output rows with zeros (Megatron splits the vocabulary over
    tensor-parallel ranks); logits of padded ids are sliced off before any softmax."""
    if spec.family != "qwen3":
        return _family(spec).hf_to_megatron(hf, spec, vocab_size)
    _check_complete(hf, spec)
    out: dict[str, Tensor] = {"embedding.word_embeddings.weight": pad_rows(hf["model.embed_tokens.weight"],
                                                                            vocab_size),
                              "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = pad_rows(hf["lm_head.weight"], vocab_size)
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[src + "self_attn.q_proj.weight"], hf[src + "self_attn.k_proj.weight"],
            hf[src + "self_attn.v_proj.weight"], spec)
        for h, m in _SIMPLE_LAYER.items():
            if src + h in hf:
                out[dst + m] = hf[src + h]
        if i in spec.moe_layers:
            for e in range(spec.num_experts):
                ex = f"{src}mlp.experts.{e}."
                out[f"{dst}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
                    [hf[ex + "gate_proj.weight"], hf[ex + "up_proj.weight"]], dim=0)
                out[f"{dst}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[ex + "down_proj.weight"]
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0)
    return out


def megatron_to_hf(mc: Mapping[str, Tensor], spec: ArchSpec) -> dict[str, Tensor]:
    """The inverse of ``hf_to_megatron``: full (unsharded) Megatron tensors -> HF checkpoint names."""
    if spec.family != "qwen3":
        return _family(spec).megatron_to_hf(mc, spec)
    inverse = {m: h for h, m in _SIMPLE_LAYER.items()}
    vocab = spec.vocab_size
    out: dict[str, Tensor] = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:vocab],
                              "model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][:vocab]
    layer = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
    for name, t in mc.items():
        m = layer.fullmatch(name)
        if not m:
            if name not in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                            "output_layer.weight") and not name.endswith("_extra_state"):
                raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in this converter")
            continue
        i, rest = int(m.group(1)), m.group(2)
        dst = f"model.layers.{i}."
        if rest == "self_attention.linear_qkv.weight":
            q, k, v = split_qkv(t, spec)
            out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                        dst + "self_attn.v_proj.weight": v})
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up})
        elif (em := re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)):
            ex = f"{dst}mlp.experts.{em.group(1)}."
            if em.group(2) == "1":
                gate, up = t.chunk(2, dim=0)
                out.update({ex + "gate_proj.weight": gate, ex + "up_proj.weight": up})
            else:
                out[ex + "down_proj.weight"] = t
        elif rest in inverse:
            out[dst + inverse[rest]] = t
        elif not rest.endswith("_extra_state"):
            raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in this converter")
    return out


def _check_complete(hf: Mapping[str, Tensor], spec: ArchSpec) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec.tied_embeddings:
        expected.add("lm_head.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        expected |= {p + s for s in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                     "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                     "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                     "input_layernorm.weight", "post_attention_layernorm.weight")}
        if i in spec.moe_layers:
            expected.add(p + "mlp.gate.weight")
            expected |= {f"{p}mlp.experts.{e}.{w}.weight" for e in range(spec.num_experts)
                         for w in ("gate_proj", "up_proj", "down_proj")}
        else:
            expected |= {p + f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
    missing = sorted(expected - set(hf))
    if missing:
        raise UserError(f"HF checkpoint is missing {len(missing)} tensors for this architecture "
                        f"(first: {missing[0]}); is it the checkpoint its config.json describes?")
    # A tied checkpoint may still carry lm_head (a copy of the embedding); nothing else may be dropped.
    unused = sorted(set(hf) - expected - {"lm_head.weight"})
    if unused:
        raise UserError(f"HF checkpoint has {len(unused)} tensors this converter would drop "
                        f"(first: {unused[0]}); refusing to convert it silently")
