"""What DeepSeek-V3 / Kimi-K2 and GLM-4.5 share beyond attention: dense layers first, then MoE layers with
a sigmoid router carrying an expert bias (``e_score_correction_bias``) and shared experts; multi-token
prediction (MTP) layers stored after the decoder; the embedding / final norm / output layer.

HF checkpoint names (one tensor per expert) <-> Megatron-core local-spec names:
- ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias`` -> ``mlp.router.weight`` /
  ``mlp.router.expert_bias``
- ``mlp.experts.E.{gate,up,down}_proj`` -> ``mlp.experts.local_experts.E.linear_fc{1,2}`` (gate rows, then up)
- ``mlp.shared_experts.{gate,up,down}_proj`` -> ``mlp.shared_experts.linear_fc{1,2}``
- dense layers: ``mlp.{gate,up,down}_proj`` -> ``mlp.linear_fc{1,2}``
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from miles_agent.errors import UserError
from miles_agent.trainers.megatron.arch_spec import ArchSpec, pad_rows

log = logging.getLogger(__name__)

_PROJ = ("gate_proj", "up_proj", "down_proj")


def moe_fields(cfg: Any, arch: str) -> dict[str, Any]:
    """The ArchSpec fields of the MoE block, from a DeepseekV3 / Glm4Moe config; refuses routing variants
    Megatron-core computes differently, naming the config key."""
    layers = cfg.num_hidden_layers
    experts = int(getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_local_experts", 0))
    topk = int(cfg.num_experts_per_tok)
    scoring = getattr(cfg, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UserError(f"{arch}: scoring_func={scoring!r} is not supported by the converter "
                        "(only 'sigmoid')")
    if not getattr(cfg, "norm_topk_prob", True) and topk > 1:
        # Megatron-core's sigmoid router always renormalizes the top-k scores.
        raise UserError(f"{arch}: norm_topk_prob=false has no Megatron-core sigmoid-router equivalent; "
                        "Megatron always renormalizes the selected scores")
    groups, group_topk = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    if groups > 1 and topk // group_topk != 2:
        # HF ranks a group by the sum of its top-2 scores, Megatron by its top-(topk / topk_group).
        raise UserError(f"{arch}: group-limited routing with num_experts_per_tok/topk_group = "
                        f"{topk}/{group_topk} != 2 ranks groups differently in Megatron-core than in HF")
    if experts % groups:
        raise UserError(f"{arch}: n_group={groups} does not divide the {experts} routed experts")
    dense_first = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
    return dict(
        num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(cfg.moe_intermediate_size),
        norm_topk_prob=True, moe_layers=tuple(range(dense_first, layers)),
        shared_expert_ffn_hidden_size=int(cfg.moe_intermediate_size) * shared,
        router_score="sigmoid", router_scaling=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
        router_groups=groups if groups > 1 else None, router_group_topk=group_topk if groups > 1 else None,
        mtp_layers=int(getattr(cfg, "num_nextn_predict_layers", 0) or 0))


def megatron_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """TransformerConfig fields for the sigmoid router and shared experts."""
    if spec.router_score != "sigmoid":
        return {}
    kw: dict[str, Any] = dict(
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
        # The bias is a checkpoint value here; the trainer never runs Megatron's bias update.
        moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=spec.router_scaling,
        moe_router_num_groups=spec.router_groups, moe_router_group_topk=spec.router_group_topk,
        moe_router_dtype="fp32",  # HF computes the router logits in float32 whatever the model dtype
    )
    if spec.shared_expert_ffn_hidden_size:
        kw.update(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                  moe_shared_expert_overlap=False)
    return kw


# -- the tensors outside the decoder layers ---------------------------------------------------------

def outer_to_megatron(hf: Mapping[str, Tensor], spec: ArchSpec, vocab_size: int | None) -> dict[str, Tensor]:
    out = {"embedding.word_embeddings.weight": pad_rows(hf["model.embed_tokens.weight"], vocab_size),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = pad_rows(hf["lm_head.weight"], vocab_size)
    return out


def outer_to_hf(mc: Mapping[str, Tensor], spec: ArchSpec) -> dict[str, Tensor]:
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:spec.vocab_size],
           "model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][:spec.vocab_size]
    return out


OUTER_MEGATRON = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")


# -- the MLP / MoE block of one layer -----------------------------------------------------------------

def mlp_hf_names(prefix: str, spec: ArchSpec, layer: int) -> set[str]:
    """Checkpoint names of layer ``layer``'s MLP block (``prefix`` = "model.layers.N.")."""
    if layer not in spec.moe_layers:
        return {f"{prefix}mlp.{w}.weight" for w in _PROJ}
    names = {prefix + "mlp.gate.weight", prefix + "mlp.gate.e_score_correction_bias"}
    names |= {f"{prefix}mlp.experts.{e}.{w}.weight" for e in range(spec.num_experts) for w in _PROJ}
    if spec.shared_expert_ffn_hidden_size:
        names |= {f"{prefix}mlp.shared_experts.{w}.weight" for w in _PROJ}
    return names


def mlp_to_megatron(hf: Mapping[str, Tensor], src: str, dst: str, spec: ArchSpec, layer: int
                    ) -> dict[str, Tensor]:
    def gated(p: str) -> Tensor:
        return torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]], dim=0)

    if layer not in spec.moe_layers:
        return {dst + "mlp.linear_fc1.weight": gated(src + "mlp."),
                dst + "mlp.linear_fc2.weight": hf[src + "mlp.down_proj.weight"]}
    out = {dst + "mlp.router.weight": hf[src + "mlp.gate.weight"],
           dst + "mlp.router.expert_bias": hf[src + "mlp.gate.e_score_correction_bias"]}
    for e in range(spec.num_experts):
        ex, mx = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}."
        out[mx + "linear_fc1.weight"] = gated(ex)
        out[mx + "linear_fc2.weight"] = hf[ex + "down_proj.weight"]
    if spec.shared_expert_ffn_hidden_size:
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = gated(src + "mlp.shared_experts.")
        out[dst + "mlp.shared_experts.linear_fc2.weight"] = hf[src + "mlp.shared_experts.down_proj.weight"]
    return out


_MLP_BACK = re.compile(r"mlp\.(?:(experts\.local_experts\.\d+\.)|(shared_experts\.))?linear_fc([12])\.weight")


def mlp_to_hf(rest: str, t: Tensor, dst: str) -> dict[str, Tensor] | None:
    """One Megatron tensor of a layer's MLP block (``rest`` = its name inside the layer) -> HF tensors;
    None when ``rest`` is not an MLP tensor."""
    if rest == "mlp.router.weight":
        return {dst + "mlp.gate.weight": t}
    if rest == "mlp.router.expert_bias":
        return {dst + "mlp.gate.e_score_correction_bias": t}
    m = _MLP_BACK.fullmatch(rest)
    if not m:
        return None
    if m.group(1):
        p = dst + "mlp.experts." + m.group(1).removeprefix("experts.local_experts.")
    elif m.group(2):
        p = dst + "mlp.shared_experts."
    else:
        p = dst + "mlp."
    if m.group(3) == "2":
        return {p + "down_proj.weight": t}
    gate, up = t.chunk(2, dim=0)
    return {p + "gate_proj.weight": gate, p + "up_proj.weight": up}


# -- completeness, and the MTP layers a real checkpoint carries --------------------------------------

def checked(hf: Mapping[str, Tensor], expected: set[str], spec: ArchSpec, arch: str) -> None:
    """Every expected tensor present; the MTP layers (``model.layers.{num_layers + k}.*``) are skipped with a
    warning (the Megatron model has no MTP head, so the RL step neither uses nor updates them); anything else
    this converter would drop is refused."""
    missing = sorted(expected - set(hf))
    if missing:
        raise UserError(f"{arch} checkpoint is missing {len(missing)} tensors (first: {missing[0]}); "
                        "is it the checkpoint its config.json describes?")
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    skipped, unused = [], []
    for name in sorted(set(hf) - expected - {"lm_head.weight"}):
        m = mtp.match(name)
        if m and spec.num_layers <= int(m.group(1)) < spec.num_layers + spec.mtp_layers:
            skipped.append(name)
        else:
            unused.append(name)
    if unused:
        raise UserError(f"{arch} checkpoint has {len(unused)} tensors this converter would drop (first: "
                        f"{unused[0]}); refusing to convert it silently")
    if skipped:
        log.warning("%s: skipping %d multi-token-prediction tensors (model.layers.%d.* .. layer %d, "
                    "num_nextn_predict_layers=%d): the Megatron model is built without the MTP head, so "
                    "training neither uses nor updates them, and exported checkpoints do not contain them",
                    arch, len(skipped), spec.num_layers, spec.num_layers + spec.mtp_layers - 1,
                    spec.mtp_layers)


def check_and_convert_outer(hf: Mapping[str, Tensor], spec: ArchSpec, vocab_size: int | None,
                            attention_hf_names: Callable[[str, ArchSpec], set[str]], arch: str) -> dict[str, Tensor]:
    """The start of every MoE architecture's ``hf_to_megatron``: check the checkpoint holds exactly the
    expected tensors (attention names from ``attention_hf_names(prefix, spec)``, MLP names from here),
    then convert the embeddings, final norm and output layer."""
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if spec.tied_embeddings
                                                                     else {"lm_head.weight"})
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        expected |= attention_hf_names(p, spec) | mlp_hf_names(p, spec, i)
    checked(hf, expected, spec, arch)
    return outer_to_megatron(hf, spec, vocab_size)
