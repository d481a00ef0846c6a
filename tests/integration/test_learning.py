"""RL learns: from the shipped warm start, GRPO raises the reward on arith-tools within minutes on 2 cores."""

from __future__ import annotations

import json
from statistics import mean

from miles_agent.config import load_config
from miles_agent.loop import train


def test_reward_rises_on_the_builtin_task(tmp_path):
    cfg = load_config("tiny-cpu", {"run.steps": 12, "run.run_dir": str(tmp_path), "run.progress": False,
                                   "run.checkpoint_every": 6})
    records = train(cfg)
    rewards = [r["reward_mean"] for r in records]
    first, last = mean(rewards[:3]), mean(rewards[-3:])
    assert last >= first + 0.2, rewards
    # the policy learned to use its tool: more calls per episode at the end than at the start
    assert mean(r["reward/tool_calls"] for r in records[-3:]) > mean(r["reward/tool_calls"] for r in records[:3])
    # weight versions advance one per step, and the engine sampled every step with the latest weights
    assert [r["weight_version"] for r in records] == list(range(12))
    for r in records:
        assert r["failed"] == 0 and r["train/grad_norm"] > 0
        assert r["train/logprob_mismatch_mean"] < 1e-3  # engine and trainer agree on the sampled tokens
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(12))
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_12"
    assert (tmp_path / "checkpoints" / "step_6" / "loop_state.json").is_file()
    assert (tmp_path / "final" / "model.safetensors").is_file()
