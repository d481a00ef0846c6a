"""RL learns through LoRA, multi-LoRA and low-precision rollouts on the built-in task (the mirror of
tests/integration/test_learning.py for full fine-tuning). Several CPU minutes each: nightly (slow)."""

from __future__ import annotations

from statistics import mean

import pytest
import torch

from miles_agent.config import load_config
from miles_agent.loop import train
from miles_agent.models.builder import build_tiny

# 2400 s was too little for the two-adapter run at load average 20-30 on 2 cores (13 of 14 steps)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def full_sync_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in build_tiny("tiny-qwen3")[0].parameters())


def gain(records, key="reward_mean") -> float:
    rewards = [r[key] for r in records]
    return mean(rewards[-3:]) - mean(rewards[:3])


def test_lora_rl_raises_the_reward_training_a_few_percent(tmp_path):
    pytest.importorskip("peft")
    cfg = load_config("tiny-cpu", {"run.steps": 14, "run.run_dir": str(tmp_path), "run.progress": False,
                                   "run.checkpoint_every": 7, "lora.rank": 4, "train.lr": 3e-4})
    records = train(cfg)
    assert gain(records) >= 0.3, [r["reward_mean"] for r in records]
    full = full_sync_bytes()
    for r in records:
        assert r["failed"] == 0 and r["train/grad_norm"] > 0
        assert 0 < r["sync_bytes"] < 0.05 * full  # the adapter only
        assert r["train/logprob_mismatch_mean"] < 1e-3  # the engine applies the adapter as peft does
    per_layer = sum(4 * (i + o) for i, o in [(128, 128), (128, 64), (128, 64), (128, 128), (128, 384),
                                             (128, 384), (384, 128)])  # rank 4 x (in + out), 7 targets
    assert records[0]["sync_bytes"] == 4 * per_layer * 4  # fp32 A and B of every target of the 4 layers
    assert (tmp_path / "final" / "default" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "step_7" / "lora" / "default" / "adapter_config.json").is_file()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_low_precision_rollouts_still_learn(tmp_path, fmt):
    if fmt == "mxfp8":
        pytest.importorskip("torchao")
    cfg = load_config("tiny-cpu", {"run.steps": 12, "run.run_dir": str(tmp_path), "run.progress": False,
                                   "run.checkpoint_every": 0, "rollout.weight_format": fmt})
    records = train(cfg)
    assert gain(records) >= 0.2, [r["reward_mean"] for r in records]
    for r in records:  # the mismatch under this precision, reported under its name: real, and small
        assert r[f"mismatch/{fmt}"] == r["train/logprob_mismatch_mean"]
        assert 1e-5 < r[f"mismatch/{fmt}"] < 0.2


def test_two_adapters_trained_together_each_improve_on_their_own_family(tmp_path):
    pytest.importorskip("peft")
    # arith-tools in two families, ids plus-train-N (+ and -) and times-train-N (*), one adapter each
    cfg = load_config("tiny-cpu", {"run.steps": 14, "run.run_dir": str(tmp_path), "run.progress": False,
                                   "run.checkpoint_every": 0, "env.options": {"family_ids": True},
                                   "lora.rank": 4, "train.lr": 3e-4,
                                   "lora.adapters": ["plus", "times"],
                                   "lora.routes": {"plus-": "plus", "times-": "times"}})
    records = train(cfg)
    one_adapter = 4 * sum(4 * (i + o) for i, o in [(128, 128), (128, 64), (128, 64), (128, 128), (128, 384),
                                                   (128, 384), (384, 128)]) * 4  # see the test above
    for r in records:
        assert r["failed"] == 0 and {"train/lora/plus/grad_norm", "train/lora/times/grad_norm"} <= set(r)
        assert r["sync_bytes"] == 2 * one_adapter  # both adapters, nothing else
        # each request ran on its task's adapter: the engine's logprobs are the trainer's for that adapter
        assert r["train/logprob_mismatch_mean"] < 1e-3
    for name in ("plus", "times"):
        assert gain(records, f"train/lora/{name}/reward_mean") >= 0.15, [r[f"train/lora/{name}/reward_mean"]
                                                                         for r in records]
        assert (tmp_path / "final" / name / "adapter_config.json").is_file()
    from safetensors.torch import load_file

    plus, times = (load_file(str(tmp_path / "final" / n / "adapter_model.safetensors")) for n in ("plus", "times"))
    assert plus.keys() == times.keys() and any(not torch.equal(plus[k], times[k]) for k in plus)
