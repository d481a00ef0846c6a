"""Each shipped GPU recipe trains 2 steps on CPU through the code path it names: Ray actors on fake GPUs
(the session's 4), its colocation and offload, bf16, its trainer backend -- with the architecture shrunk to
a built-in tiny one (MoE recipes: the tiny Qwen3-MoE), the parallel sizes scaled down to 2 ranks, and the
embedded engine in place of SGLang (which needs CUDA)."""

from __future__ import annotations

import pytest
from conftest import train_then_close

from miles_agent.config import load_config
from miles_agent.loop import Run

SHRINK = {"model.hf_checkpoint": None, "model.warm_start": None, "model.device": "cpu", "model.dtype": "bfloat16",
          "rollout.engine": "embedded", "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
          "rollout.concurrency": 4, "rollout.max_batch_size": 4, "env.name": "arith-tools", "env.max_turns": 2,
          "env.max_total_tokens": 256, "env.max_new_tokens_per_turn": 8, "env.max_observation_tokens": 32,
          "train.micro_batch_tokens": 1024, "run.steps": 2, "run.progress": False, "run.checkpoint_every": 0,
          "cluster.health_check_interval_s": 0}
MEGATRON = {"megatron.tensor_parallel": 1, "megatron.pipeline_parallel": 1, "megatron.first_stage_layers": None,
            "megatron.last_stage_layers": None}
RECIPES = {  # recipe -> (tiny architecture, trainer ranks, its own shrunk parallel sizes)
    "qwen3-0.6b-1gpu": ("tiny-qwen3", 1, {}),
    "qwen3-8b": ("tiny-qwen3", 2, {}),
    "qwen3-30b-a3b": ("tiny-qwen3-moe", 2, {**MEGATRON, "megatron.expert_parallel": 2}),
    "glm-4.5-air": ("tiny-qwen3-moe", 2, {**MEGATRON, "megatron.expert_parallel": 2}),
    "deepseek-v3": ("tiny-qwen3-moe", 2, {**MEGATRON, "megatron.expert_parallel": 2}),
    "kimi-k2": ("tiny-qwen3-moe", 2, {**MEGATRON, "megatron.expert_parallel": 2}),
}
FAST = "qwen3-0.6b-1gpu"  # the representative that stays in the fast suite


def shrunk(recipe: str, run_dir: str):
    arch, world, sizes = RECIPES[recipe]
    engines = min(load_config(recipe).cluster.num_engines, world)
    return load_config(recipe, {**SHRINK, **sizes, "model.arch": arch, "train.world_size": world,
                                "cluster.num_engines": engines, "run.run_dir": run_dir})


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=() if r == FAST else pytest.mark.slow) for r in RECIPES])
def test_recipe_trains_two_steps_on_its_code_path(recipe, ray_session, tmp_path):
    full = load_config(recipe)
    cfg = shrunk(recipe, str(tmp_path))
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
