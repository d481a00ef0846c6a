"""Models and tokenizers, offline: tiny Qwen3 / Qwen3-MoE from transformers configs, or any HF folder.

The tiny architectures are real transformers models with random init, so every code path that
serves a hub checkpoint (HF loading, safetensors, chat templates) runs here without a download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError

VISION_TOKEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                    "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}

# Small enough to train in minutes on 2 CPU cores, large enough to learn a tool-use format.
# Qwen3 normalizes queries and keys (QK-norm), so with norm weights at 1 an attention logit is at most
# sqrt(head_dim) and a tiny model needs thousands of steps to sharpen attention enough to copy from
# its context (tool arguments, tool results). Starting the norm weights at this gain lets it learn
# copying in a few hundred steps; checkpoints carry the learned weights, so loading is unaffected.
TINY_QK_NORM_INIT = 2.5
TINY_ARCHS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": dict(
        model_type="qwen3", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # Qwen3-VL: the tiny Qwen3 decoder (interleaved 3-D M-RoPE, mrope_section sums to head_dim / 2) behind a
    # 2-block ViT whose 2x2-merged patches, plus DeepStack features of both blocks, feed the decoder.
    "tiny-qwen3-vl": dict(
        model_type="qwen3_vl",
        text_config=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128,
                           deepstack_visual_indexes=[0, 1], num_position_embeddings=256),
        tie_word_embeddings=True,
    ),
}


def tiny_config(arch: str, tokenizer) -> Any:  # noqa: ANN001
    """A transformers config for a built-in tiny architecture, sized to the tokenizer."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise UserError(f"unknown model arch {arch!r}; choose one of {', '.join(TINY_ARCHS)} "
                        "or set model.hf_checkpoint to an HF-format folder")
    spec = dict(TINY_ARCHS[arch])
    model_type = spec.pop("model_type")
    if "vision_config" in spec:  # the vision tokens are the tokenizer's (build_byte_tokenizer(vision=True))
        ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in VISION_TOKEN_IDS.items()}
        text = dict(spec.pop("text_config"), vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
        return AutoConfig.for_model(model_type, text_config=text, **ids, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id, **spec)
    return AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **spec)


def build_tiny(arch: str, seed: int = 0, dtype: str = "float32"):  # noqa: ANN201
    """(model, tokenizer) for a tiny architecture with a seeded random init."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from miles_agent.models.tokenizer import build_byte_tokenizer

    vision = "vision_config" in TINY_ARCHS.get(arch, {})
    tokenizer = build_byte_tokenizer(vision=vision)
    config = tiny_config(arch, tokenizer)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=getattr(torch, dtype))
    decoder = getattr(model.model, "language_model", model.model)
    with torch.no_grad():
        for layer in decoder.layers:
            layer.self_attn.q_norm.weight.fill_(TINY_QK_NORM_INIT)
            layer.self_attn.k_norm.weight.fill_(TINY_QK_NORM_INIT)
    model.config.architectures = [type(model).__name__]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), with_vision(tokenizer, model)


def with_vision(tokenizer: Any, model: Any) -> Any:
    """A vision-language model's tokenizer names its image placeholder id: harnesses then send images."""
    cfg = model.config
    if getattr(cfg, "vision_config", None) is not None and getattr(cfg, "image_token_id", None) is not None:
        tokenizer.image_placeholder_id = int(cfg.image_token_id)
    return tokenizer


def check_safetensors(path: Path) -> None:
    """A truncated or corrupt .safetensors file is a UserError naming it, not a deserializer traceback."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):  # checks that the header parses and covers the file
            pass
    except Exception as e:  # noqa: BLE001 - SafetensorError, or an OSError on a header past the file's end
        raise UserError(f"{path} is truncated or corrupt ({e}); re-copy or re-save the checkpoint, or resume "
                        "from an earlier one") from None


def load_hf(path: str | Path, dtype: str = "float32"):  # noqa: ANN201
    """(model, tokenizer) from an HF-format folder; a clear error when the folder is not one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise UserError(f"checkpoint folder {p} does not exist; pass --hf-checkpoint a folder holding "
                        "config.json and *.safetensors (e.g. one written by save_pretrained)")
    if not (p / "config.json").is_file():
        raise UserError(f"{p} has no config.json, so it is not an HF-format checkpoint; "
                        "point --hf-checkpoint at the folder that holds config.json")
    try:
        arch = json.loads((p / "config.json").read_text()).get("architectures")
    except json.JSONDecodeError as e:
        raise UserError(f"{p / 'config.json'} is not valid JSON ({e.msg}); the checkpoint is damaged") from None
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise UserError(f"{p} has a config but no weights (*.safetensors); the checkpoint is incomplete")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError) as e:
        raise UserError(f"{p} has no usable tokenizer ({e}); save the tokenizer with the model") from None
    for f in sorted(p.glob("*.safetensors")):
        check_safetensors(f)
    vision = "vision_config" in json.loads((p / "config.json").read_text())
    if vision:
        from transformers import AutoModelForImageTextToText as AutoModelForCausalLM  # noqa: N814
    model = AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, dtype))
    if arch is None:
        model.config.architectures = [type(model).__name__]
    return model.eval(), with_vision(tokenizer, model)


def save_hf(model, tokenizer, path: str | Path) -> None:  # noqa: ANN001
    """Write an HF-format folder (config, safetensors, tokenizer) atomically: temp folder, then rename."""
    import shutil

    from miles_agent.atomic import replace_dir

    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    replace_dir(tmp, p)
