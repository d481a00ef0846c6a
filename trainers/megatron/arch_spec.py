"""What every architecture's converter shares (bridge.py for Qwen3, arch_*.py for the others): the
architecture spec read from an HF config, and the fused-tensor layouts Megatron keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_agent.errors import UserError


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-latent attention dimensions (see arch_deepseek.py)."""

    q_lora_rank: int | None  # None: queries are projected directly (no low-rank down/up pair)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # HF rope_interleave: rotary dims come in (even, odd) pairs
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # yarn parameters, () for plain rope


@dataclass(frozen=True)
class ArchSpec:
    """What the converter needs to know about one HF architecture."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int
    num_experts: int = 0  # 0 = dense
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()  # indices of MoE layers (the others are dense)
    # Beyond Qwen3 (arch_deepseek.py, arch_glm.py); the defaults are Qwen3's.
    family: str = "qwen3"  # which converter in CONVERTERS handles the tensors
    qkv_bias: bool = False
    qk_norm: bool = True
    rotary_percent: float = 1.0
    shared_expert_ffn_hidden_size: int = 0  # 0 = no shared experts
    router_score: str = "softmax"  # "sigmoid": DeepSeek-V3 / GLM-4.5 routing with an expert bias
    router_scaling: float = 1.0  # routed_scaling_factor
    router_groups: int | None = None  # group-limited routing: n_group / topk_group
    router_group_topk: int | None = None
    mtp_layers: int = 0  # multi-token-prediction layers a checkpoint carries after the decoder (skipped)
    mla: MLASpec | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None:
        raise UserError("the HF config has no rope_theta (nor rope_parameters.rope_theta); "
                        "add it to config.json")
    return float(theta)


# -- fused tensors -----------------------------------------------------------------------------------

def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, spec: ArchSpec) -> Tensor:
    d, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    qg = q.reshape(groups, per_group * d, -1)
    kg = k.reshape(groups, d, -1)
    vg = v.reshape(groups, d, -1)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, q.shape[-1])


def split_qkv(qkv: Tensor, spec: ArchSpec) -> tuple[Tensor, Tensor, Tensor]:
    d, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    g = qkv.reshape(groups, (per_group + 2) * d, -1)
    q, k, v = torch.split(g, [per_group * d, d, d], dim=1)
    width = qkv.shape[-1]
    return q.reshape(-1, width), k.reshape(-1, width), v.reshape(-1, width)


def pad_rows(t: Tensor, rows: int | None) -> Tensor:
    if rows is None or rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        raise ValueError(f"cannot pad a vocabulary of {t.shape[0]} rows down to {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
