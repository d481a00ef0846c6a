"""Every shipped recipe parses, and its parallel layout fits the model it names (the dimensions come
from recipes/architectures/<checkpoint folder name>.json, copied from the public config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_agent.config import RECIPES_DIR, available_recipes, load_config

ARCHS = RECIPES_DIR / "architectures"
REAL_MODEL_RECIPES = [r for r in available_recipes() if not r.startswith("tiny")]


def test_real_model_recipes_are_shipped():
    assert {"qwen3-8b", "qwen3-30b-a3b", "glm-4.5-air", "deepseek-v3", "kimi-k2"} <= set(REAL_MODEL_RECIPES)


@pytest.mark.parametrize("name", available_recipes())
def test_recipe_parses(name):
    load_config(name)


@pytest.mark.parametrize("name", REAL_MODEL_RECIPES)
def test_parallel_sizes_fit_the_model(name):
    pytest.importorskip("torch")
    from miles_agent.trainers.megatron.model import ParallelSizes, layout_spec

    cfg = load_config(name)
    assert cfg.model.hf_checkpoint, f"{name}: a real-model recipe names its checkpoint"
    arch_file = ARCHS / f"{Path(cfg.model.hf_checkpoint).name}.json"
    assert arch_file.is_file(), f"{name}: add {arch_file} (the model's config.json dimensions)"
    spec = layout_spec(json.loads(arch_file.read_text()))
    world = cfg.train.world_size
    if cfg.train.backend == "megatron":
        m = cfg.megatron
        ParallelSizes(tensor=m.tensor_parallel, pipeline=m.pipeline_parallel, expert=m.expert_parallel,
                      context=m.context_parallel, expert_tensor=m.expert_tensor_parallel,
                      first_stage_layers=m.first_stage_layers, last_stage_layers=m.last_stage_layers,
                      ).check(spec, world_size=world)
    else:
        assert world >= 1 and cfg.train.backend == "fsdp2"
    if cfg.rollout.engine == "sglang":
        tp = cfg.sglang.tp_size
        assert spec.num_heads % tp == 0, f"{name}: sglang.tp_size={tp} does not divide {spec.num_heads} heads"
        # colocated layout: the rollout servers cover exactly the training GPUs
        assert cfg.sglang.num_servers * tp == world, f"{name}: {cfg.sglang.num_servers} x TP {tp} != {world} GPUs"


def test_a_layout_that_does_not_fit_is_caught():
    from miles_agent.errors import UserError
    from miles_agent.trainers.megatron.model import ParallelSizes, layout_spec

    spec = layout_spec(json.loads((ARCHS / "Qwen3-30B-A3B.json").read_text()))
    with pytest.raises(UserError, match="tensor_parallel=3"):
        ParallelSizes(tensor=3).check(spec, world_size=6)
    with pytest.raises(UserError, match="expert_parallel"):
        ParallelSizes(tensor=2, expert=32).check(spec, world_size=16)  # 32 expert ranks > 16 ranks per stage


@pytest.mark.parametrize("name", REAL_MODEL_RECIPES)
def test_under_ray_the_recipe_reserves_the_gpus_it_states(name):
    from miles_agent.runtime.ray_cluster import bundle_specs

    cfg = load_config(name)
    c = cfg.cluster
    assert (c.mode, c.colocate) == ("ray", True), f"{name}: a GPU recipe states its layout"
    span = cfg.sglang.tp_size if cfg.rollout.engine == "sglang" else 1
    bundles, ranks, engines = bundle_specs(c, cfg.train.world_size, span)
    assert sum(b.get("GPU", 0) for b in bundles) == cfg.train.world_size <= c.nodes * c.gpus_per_node
    assert len(engines) == c.num_engines and engines[-1] + span <= len(ranks)
    if cfg.rollout.engine == "sglang":
        assert c.num_engines == cfg.sglang.num_servers
