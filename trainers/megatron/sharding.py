"""Which slice of each full Megatron tensor a (tensor, pipeline, expert) rank holds, and the way back.

Megatron-core's own rules, stated once:
- column-parallel weights (fused QKV, the output layer, the vocabulary of the embedding) split rows;
  the fused QKV splits into whole query groups because its rows are grouped that way (bridge.py);
- row-parallel weights (attention output, MLP down projection) split columns;
- the gated ``linear_fc1`` splits gate and up separately: rank r holds [gate_r; up_r]; shared experts
  (DeepSeek-V3, GLM-4.5) are a tensor-parallel MLP like a dense layer's;
- experts go whole to expert-parallel ranks (local indices restart at 0); their own matrices split
  over expert-tensor-parallel ranks by the same column/row rules;
- norms and the router are replicated; pipeline stages hold contiguous layers, numbered from 0 in
  each stage, the first stage the embedding, the last the final norm and the output layer (a copy
  of the embedding when they are tied).
``merge`` checks that replicated copies agree, so a desynchronized rank is caught, not averaged away.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_agent.trainers.megatron.arch_spec import ArchSpec
from miles_agent.trainers.megatron.model import ParallelSizes

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")


@dataclass(frozen=True, order=True)
class RankCoords:
    tensor: int = 0
    pipeline: int = 0
    expert: int = 0
    expert_tensor: int = 0


def stage_layers(spec: ArchSpec, sizes: ParallelSizes, stage: int) -> range:
    per_stage = sizes.stage_sizes(spec.num_layers)
    if per_stage is None:
        sizes.check(spec)  # raises with the reason
        raise AssertionError("unreachable")
    start = sum(per_stage[:stage])
    return range(start, start + per_stage[stage])


def _split(t: Tensor, how: str, parts: int, rank: int) -> Tensor:
    if how == "rows":
        return t.chunk(parts, dim=0)[rank]
    if how == "cols":
        return t.chunk(parts, dim=1)[rank]
    if how == "gated":
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(parts, dim=0)[rank], up.chunk(parts, dim=0)[rank]])
    return t


def _join(pieces: list[Tensor], how: str) -> Tensor:
    if how == "rows":
        return torch.cat(pieces, dim=0)
    if how == "cols":
        return torch.cat(pieces, dim=1)
    if how == "gated":
        gates, ups = zip(*(p.chunk(2, dim=0) for p in pieces))
        return torch.cat([*gates, *ups])
    first = pieces[0]
    for p in pieces[1:]:
        if not torch.equal(p, first):
            raise ValueError("replicated copies of a tensor differ across ranks")
    return first


# Column-parallel in the local layer specs. MLA (arch_deepseek.py): the local spec builds even the down
# projections column-parallel (rows split, outputs all-gathered before the latent norms); the up
# projections split whole heads because their rows are per head.
_ROWS = {"self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         *(f"self_attention.linear_{p}.weight" for p in ("q_proj", "q_down_proj", "q_up_proj", "kv_down_proj",
                                                          "kv_up_proj"))}


def _layer_rule(rest: str) -> str:
    if rest in _ROWS:
        return "rows"
    if rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
                "mlp.shared_experts.linear_fc2.weight"):
        return "cols"
    if rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        return "gated"
    return "replicated"  # norms, the router and its expert bias


def shard(full: Mapping[str, Tensor], spec: ArchSpec, sizes: ParallelSizes, at: RankCoords) -> dict[str, Tensor]:
    """The tensors rank ``at`` holds, under the names its GPTModel's state_dict uses."""
    out: dict[str, Tensor] = {}
    first, last = at.pipeline == 0, at.pipeline == sizes.pipeline - 1
    layers = stage_layers(spec, sizes, at.pipeline)
    experts_per_rank = spec.num_experts // sizes.expert if spec.is_moe else 0
    for name, t in full.items():
        if name == "embedding.word_embeddings.weight":
            if first:
                out[name] = _split(t, "rows", sizes.tensor, at.tensor)
            if last and spec.tied_embeddings and sizes.pipeline > 1:
                out["output_layer.weight"] = _split(t, "rows", sizes.tensor, at.tensor)
        elif name == "output_layer.weight":
            if last:
                out[name] = _split(t, "rows", sizes.tensor, at.tensor)
        elif name == "decoder.final_layernorm.weight":
            if last:
                out[name] = t
        elif (m := _LAYER.fullmatch(name)):
            layer, rest = int(m.group(1)), m.group(2)
            if layer not in layers:
                continue
            local = f"decoder.layers.{layer - layers.start}."
            if (em := _EXPERT.fullmatch(rest)):
                expert = int(em.group(1))
                if expert // experts_per_rank != at.expert:
                    continue
                how = "gated" if em.group(2) == "linear_fc1" else "cols"
                out[f"{local}mlp.experts.local_experts.{expert % experts_per_rank}.{em.group(2)}.weight"] = \
                    _split(t, how, sizes.expert_tensor, at.expert_tensor)
            else:
                out[local + rest] = _split(t, _layer_rule(rest), sizes.tensor, at.tensor)
        else:
            raise ValueError(f"no sharding rule for Megatron tensor {name!r}")
    return out


def merge(states: Mapping[RankCoords, Mapping[str, Tensor]], spec: ArchSpec, sizes: ParallelSizes
          ) -> dict[str, Tensor]:
    """Full Megatron tensors from every rank's local state (the inverse of ``shard``)."""
    pieces: dict[str, dict[tuple[int, int], Tensor]] = {}  # full name -> (split index, replica) -> piece
    rules: dict[str, str] = {}
    experts_per_rank = spec.num_experts // sizes.expert if spec.is_moe else 0
    for at, state in states.items():
        layers = stage_layers(spec, sizes, at.pipeline)
        for name, t in state.items():
            if name.endswith("_extra_state"):
                continue
            split_rank, replica = at.tensor, (at.pipeline, at.expert, at.expert_tensor)
            if name == "output_layer.weight" and spec.tied_embeddings:
                continue  # the last stage's copy of the embedding
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                full, how = name, "rows"
            elif name == "decoder.final_layernorm.weight":
                full, how = name, "replicated"
            else:
                m = _LAYER.fullmatch(name)
                if not m:
                    raise ValueError(f"no sharding rule for Megatron tensor {name!r}")
                layer, rest = int(m.group(1)) + layers.start, m.group(2)
                if (em := _EXPERT.fullmatch(rest)):
                    expert = at.expert * experts_per_rank + int(em.group(1))
                    full = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{em.group(2)}.weight"
                    how = "gated" if em.group(2) == "linear_fc1" else "cols"
                    split_rank, replica = at.expert_tensor, (at.tensor,)
                else:
                    full, how = f"decoder.layers.{layer}.{rest}", _layer_rule(rest)
                    replica = (at.expert, at.expert_tensor)
            if how == "replicated":
                replica, split_rank = (*replica, split_rank), 0
            pieces.setdefault(full, {})[(split_rank, hash(replica))] = t
            rules[full] = how
    out = {}
    for full, by_rank in pieces.items():
        ranks = sorted({r for r, _ in by_rank})
        if rules[full] == "replicated":
            out[full] = _join(list(by_rank.values()), "replicated")
            continue
        ordered = []
        for r in ranks:
            copies = [t for (rr, _), t in by_rank.items() if rr == r]
            ordered.append(_join(copies, "replicated"))
        out[full] = _join(ordered, rules[full])
    return out
