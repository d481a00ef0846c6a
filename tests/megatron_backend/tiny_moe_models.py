"""Tiny random-init DeepseekV3 / Glm4Moe models from transformers configs, saved and read back as an HF
checkpoint, with every tensor that a default init leaves constant (norms, router, expert bias) randomized so
that a layout bug changes the logits."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

VOCAB = 256


def _rope(yarn: bool) -> dict:
    if not yarn:
        return {"rope_theta": 10000.0, "rope_type": "default"}
    # mscale_all_dim != mscale: both the rope cos/sin factor and the softmax scale differ from 1
    return {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def deepseek_config(*, q_lora_rank: int | None = 32, yarn: bool = False,  # noqa: ANN201
                    rope_interleave: bool = True, layers: int = 3):
    from transformers import DeepseekV3Config

    # 3 layers: 1 dense then MoE ones; 8 experts in 4 groups, 2 groups per token, top-4 (HF and Megatron rank
    # groups by the sum of their top-2 scores alike only when top_k / topk_group = 2, as in DeepSeek-V3)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1,
        max_position_embeddings=256, rope_parameters=_rope(yarn), rope_interleave=rope_interleave,
        tie_word_embeddings=False, rms_norm_eps=1e-6)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def glm_config(*, use_qk_norm: bool = True):  # noqa: ANN201
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=1.5, n_group=1, topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1,
        max_position_embeddings=256, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                      "rope_type": "default"},
        attention_bias=True, use_qk_norm=use_qk_norm, tie_word_embeddings=False, rms_norm_eps=1e-5)
    cfg.architectures = ["Glm4MoeForCausalLM"]
    return cfg


def tiny_checkpoint(config, tmp: Path, seed: int = 0):  # noqa: ANN001, ANN201
    """(model, HF checkpoint tensors as written to disk) for a transformers config."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are picked
                b.copy_(0.3 * torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight") or name.endswith("_proj.bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(tmp).glob("*.safetensors")):
        tensors.update(load_file(f))
    return model, tensors
