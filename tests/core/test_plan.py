"""`miles-agent plan`: every shipped GPU recipe plans on the hardware it states, an impossible one is
refused with one line naming the fix, and the memory model's numbers equal a hand count."""

from __future__ import annotations

import json

import pytest

from miles_agent.cli import main
from miles_agent.config import RECIPES_DIR, available_recipes, load_config

GPU_RECIPES = [r for r in available_recipes() if not r.startswith("tiny")]
ARCHS = RECIPES_DIR / "architectures"


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_each_recipe_plans_on_its_stated_hardware(recipe, capsys):
    cfg = load_config(recipe)
    assert cfg.cluster.mode == "ray" and cfg.train.world_size <= cfg.cluster.nodes * cfg.cluster.gpus_per_node
    rc, out, err = plan(capsys, "--recipe", recipe)
    assert rc == 0, err
    gpu_lines = [line for line in out.splitlines() if line.startswith("  node ")]
    assert len(gpu_lines) == cfg.train.world_size  # colocated: one line per trainer GPU, each with its rank
    assert all(f"trainer rank {i}," in line for i, line in enumerate(gpu_lines))
    assert "engine 0" in gpu_lines[0] and "activations, checkpointed" in out and "  peak " in out


def test_the_plan_counts_what_the_recipe_runs_with(capsys):
    """32k-token trajectories on Qwen3-8B fit 80 GiB only with activation checkpointing: the plan reads
    the recipe's own train.activation_checkpointing, and without it refuses, naming that key."""
    rc, out, err = plan(capsys, "--recipe", "qwen3-8b", "train.activation_checkpointing=false")
    assert rc != 0 and "set train.activation_checkpointing=true" in err
    rc, out, err = plan(capsys, "--recipe", "qwen3-8b")
    assert rc == 0 and "activations, checkpointed" in out and "logits, in chunks" in out


@pytest.mark.parametrize("memory", ["24", "80"])
def test_the_one_gpu_recipe_plans_on_24_and_80_gib(memory, capsys):
    rc, out, err = plan(capsys, "--recipe", "qwen3-0.6b-1gpu", "--gpu-memory", memory)
    assert rc == 0, err
    assert "node 0 gpu 0: trainer rank 0, engine 0" in out


def test_qwen3_1_7b_needs_the_80_gib_gpu(capsys):
    bigger = "model.hf_checkpoint=/models/Qwen3-1.7B"
    assert plan(capsys, "--recipe", "qwen3-0.6b-1gpu", "--gpu-memory", "80", bigger)[0] == 0
    rc, _, err = plan(capsys, "--recipe", "qwen3-0.6b-1gpu", "--gpu-memory", "24", bigger)
    assert rc == 2 and "a GPU needs" in err and "of 24" in err


@pytest.mark.parametrize("args, fix", [
    (["--recipe", "qwen3-8b", "--gpus-per-node", "4"], "use --nodes 2"),
    (["--recipe", "deepseek-v3", "sglang.mem_fraction_static=0.55"], "raise sglang.tp_size or sglang.mem_fraction_static"),
    (["--recipe", "qwen3-8b", "cluster.trainer_gpus=0"], "set cluster.trainer_gpus=1"),
    (["--recipe", "qwen3-8b", "cluster.mode=inprocess"], "set cluster.mode=ray"),
    (["--recipe", "qwen3-30b-a3b", "cluster.num_engines=4"], "set both to one number"),
    (["--recipe", "glm-4.5-air", "--gpu-memory", "40"], "raise sglang.tp_size"),
    (["--recipe", "qwen3-30b-a3b", "megatron.expert_parallel=1"], "or the parallel sizes (megatron.*)"),
    (["--recipe", "qwen3-8b", "--nodes", "0"], "positive numbers"),
])
def test_an_impossible_plan_is_refused_with_its_fix(args, fix, capsys):
    rc, out, err = plan(capsys, *args)
    assert rc == 2 and not out
    assert fix in err and len(err.strip().splitlines()) == 1


def test_a_cpu_recipe_has_nothing_to_place(capsys):
    rc, out, _ = plan(capsys, "--recipe", "tiny-cpu")
    assert rc == 0 and "nothing to place" in out


# -- the memory model against a hand count -----------------------------------------------------------

def shape(name: str):
    from miles_agent.runtime.memory_model import model_shape

    return model_shape(json.loads((ARCHS / f"{name}.json").read_text()))


def test_dense_qwen3_8b_by_hand():
    from miles_agent.runtime.memory_model import Sharding, train_memory

    h, layers, d, ffn, vocab = 4096, 36, 128, 12288, 151936
    attn = h * 32 * d + 2 * h * 8 * d + 32 * d * h + 2 * d + 2 * h  # q, k, v, o, q/k norms, two RMSNorms
    total = layers * (attn + 3 * h * ffn) + 2 * vocab * h + h  # untied embedding and head, final norm
    s = shape("Qwen3-8B")
    assert s.total_params == total == s.active_params
    assert abs(total / 8.19e9 - 1) < 0.01  # the model card's 8.2B
    m = train_memory(s, Sharding("fsdp2", 8), micro_batch_tokens=16384)
    assert m.optimizer == pytest.approx(8 * total / 8) and m.gradients == pytest.approx(4 * total / 8)
    assert m.logits == 4 * 16384 * vocab
    per_token_layer = 2 * (4 * h + (32 + 2 * 8) * d + 32 * d + 4 * ffn)
    assert m.activations == layers * 16384 * per_token_layer
    assert m.activations_checkpointed == layers * 16384 * h * 2 + 16384 * per_token_layer
    assert s.kv_bytes_per_token() == layers * 2 * 8 * d * 2


def test_moe_qwen3_30b_a3b_by_hand_under_megatron():
    from miles_agent.runtime.memory_model import Sharding, train_memory

    h, layers, d, e, f, vocab = 2048, 48, 128, 128, 768, 151936
    attn = h * 32 * d + 2 * h * 4 * d + 32 * d * h + 2 * d + 2 * h
    routed = layers * e * 3 * h * f
    router = layers * e * h
    embed = 2 * vocab * h
    s = shape("Qwen3-30B-A3B")
    assert s.total_params == layers * attn + router + routed + embed + h
    assert abs(s.total_params / 30.5e9 - 1) < 0.01 and abs(s.active_params / 3.3e9 - 1) < 0.03
    tp, ep = 2, 8
    m = train_memory(s, Sharding("megatron", 16, tp=tp, ep=ep), micro_batch_tokens=16384)
    dense_on_rank = (layers * attn + router + h) / tp + embed / tp
    on_rank = dense_on_rank + routed / ep
    assert m.params_on_rank == pytest.approx(on_rank)
    # fp32 main params + two Adam moments, whole on every data-parallel rank (the trainer has no ZeRO-1 yet)
    optimizer = 12 * on_rank
    assert (m.weights, m.gradients, m.optimizer) == pytest.approx((2 * on_rank, 4 * on_rank, optimizer))
    assert s.kv_bytes_per_token(tp=2) == layers * 2 * (4 // 2) * d * 2


@pytest.mark.parametrize("name, total, active", [("DeepSeek-V3", 671e9, 37e9), ("Kimi-K2-Instruct", 1.03e12, 32e9),
                                                 ("GLM-4.5-Air", 106e9, 12e9)])
def test_large_moe_counts_match_the_published_totals(name, total, active):
    s = shape(name)
    assert abs(s.total_params / total - 1) < 0.02
    # model cards differ on whether the embeddings count as active: the published figure lies between
    assert (s.active_params - s.embed_params) * 0.97 <= active <= s.active_params * 1.03


@pytest.mark.parametrize("arch", sorted(p.stem for p in ARCHS.glob("*.json")))
def test_parameter_counts_equal_the_transformers_model_of_the_config(arch):
    """Independent of the hand count: transformers builds each architecture on the meta device (no memory)
    and its checkpoint tensors (the state dict: expert score biases are buffers there) are counted."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((ARCHS / f"{arch}.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    model_type = {"kimi_k2": "deepseek_v3"}.get(config["model_type"], config["model_type"])  # same architecture
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs))
    tied = model.config.tie_word_embeddings
    count = sum(v.numel() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight"))
    assert shape(arch).total_params == count


def test_a_disaggregated_layout_puts_engines_after_the_trainer(capsys):
    rc, out, err = plan(capsys, "--recipe", "qwen3-30b-a3b", "cluster.colocate=false", "cluster.trainer_gpus=1",
                        "cluster.gpus_per_engine=2", "cluster.num_engines=4", "sglang.num_servers=4",
                        "train.world_size=8", "megatron.expert_parallel=8", "megatron.tensor_parallel=4",
                        "--nodes", "2")
    assert rc == 0, err
    gpus = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("  node ")]
    assert gpus[:8] == [f"trainer rank {r}" for r in range(8)]
    assert gpus[8:] == [f"engine {i} (TP rank {k}/2)" for i in range(4) for k in range(2)]
    assert "node 1 gpu 0: engine 0 (TP rank 0/2)" in out
    rc, _, err = plan(capsys, "--recipe", "qwen3-30b-a3b", "cluster.colocate=false", "cluster.trainer_gpus=1",
                      "cluster.gpus_per_engine=1", "train.world_size=8", "megatron.expert_parallel=8")
    assert rc == 2 and "needs cluster.gpus_per_engine=2" in err
