"""Each shipped GPU recipe trains 2 steps on CPU through the code path it names: Ray actors on fake GPUs
(the session's 4), its colocation and offload, bf16, its trainer backend -- with its architecture
(recipes/architectures/) shrunk to a few small layers and saved as an HF checkpoint, the parallel sizes
scaled down to 2 ranks, and the embedded engine in place of SGLang (which needs CUDA). The embedded engine
serves Qwen3 and Qwen3-MoE only, so the GLM-4.5, DeepSeek-V3 and Kimi-K2 recipes run a shrunk Qwen3-MoE;
their own architectures go through the Megatron converter in tests/megatron_backend (test_bridge_glm.py,
test_bridge_deepseek.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import train_then_close

from miles_agent.config import RECIPES_DIR, load_config
from miles_agent.loop import Run

# The dimensions a shrunk architecture gets; the real config.json's other keys (tied embeddings, ...) are kept.
SMALL = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
ENGINE_SERVES = ("qwen3", "qwen3_moe")  # what the embedded engine (engines/embedded/model_runner.py) runs


def shrunk_checkpoint(recipe: str, folder: Path) -> str:
    """The recipe's architecture (its config.json copy) at toy size, random-init, as an HF folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles_agent.models.builder import save_hf
    from miles_agent.models.tokenizer import build_byte_tokenizer

    name = Path(load_config(recipe).model.hf_checkpoint).name
    real = json.loads((RECIPES_DIR / "architectures" / f"{name}.json").read_text())
    if real["model_type"] not in ENGINE_SERVES:
        real = json.loads((RECIPES_DIR / "architectures" / "Qwen3-30B-A3B.json").read_text())
    cfg = {k: v for k, v in real.items() if k not in ("architectures", "model_type", "vocab_size")}
    cfg.update(SMALL, **({"num_experts": 8, "num_experts_per_tok": 4} if "num_experts" in cfg else {}))
    tok = build_byte_tokenizer()
    config = AutoConfig.for_model(real["model_type"], vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **cfg)
    config.architectures = real["architectures"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    save_hf(model, tok, folder)
    return str(folder)


SHRINK = {"model.warm_start": None, "model.device": "cpu", "model.dtype": "bfloat16",
          "rollout.engine": "embedded", "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
          "rollout.concurrency": 4, "rollout.max_batch_size": 4, "env.name": "arith-tools", "env.max_turns": 2,
          "env.max_total_tokens": 256, "env.max_new_tokens_per_turn": 8, "env.max_observation_tokens": 32,
          "train.micro_batch_tokens": 1024, "run.steps": 2, "run.progress": False, "run.checkpoint_every": 0,
          "cluster.health_check_interval_s": 0}
MEGATRON = {"megatron.tensor_parallel": 1, "megatron.pipeline_parallel": 1, "megatron.first_stage_layers": None,
            "megatron.last_stage_layers": None}
RECIPES = {  # recipe -> (trainer ranks, its own shrunk parallel sizes)
    "qwen3-0.6b-1gpu": (1, {}),
    "qwen3-8b": (2, {}),
    "qwen3-30b-a3b": (2, {**MEGATRON, "megatron.expert_parallel": 2}),
    "glm-4.5-air": (2, {**MEGATRON, "megatron.expert_parallel": 2}),
    "deepseek-v3": (2, {**MEGATRON, "megatron.expert_parallel": 2}),
    "kimi-k2": (2, {**MEGATRON, "megatron.expert_parallel": 2}),
}
FAST = "qwen3-0.6b-1gpu"  # the representative that stays in the fast suite


def shrunk(recipe: str, tmp: Path):
    world, sizes = RECIPES[recipe]
    engines = min(load_config(recipe).cluster.num_engines, world)
    return load_config(recipe, {**SHRINK, **sizes, "model.hf_checkpoint": shrunk_checkpoint(recipe, tmp / "model"),
                                "train.world_size": world, "cluster.num_engines": engines,
                                "run.run_dir": str(tmp / "run")})


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=() if r == FAST else pytest.mark.slow) for r in RECIPES])
def test_recipe_trains_two_steps_on_its_code_path(recipe, ray_session, tmp_path):
    full = load_config(recipe)
    cfg = shrunk(recipe, tmp_path)
    assert (cfg.cluster.mode, cfg.cluster.colocate, cfg.train.backend) == (full.cluster.mode, full.cluster.colocate,
                                                                          full.train.backend)
    if cfg.train.backend == "megatron":
        pytest.importorskip("megatron.core")
    run = Run(cfg)
    records, memory_log = train_then_close(run)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["train/loss"] == r["train/loss"] for r in records)  # finite, not NaN
    events = [e for e, _, _ in memory_log]
    assert events.count("offload") >= 2 and "reload" in events  # colocated: the state left the device
