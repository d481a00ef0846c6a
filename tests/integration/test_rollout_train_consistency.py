"""The driver loop with R3 and with true on-policy mode: multi-turn tool-use episodes on the tiny MoE."""

from __future__ import annotations

from miles_agent.config import load_config
from miles_agent.loop import train

TINY_RUN = {"model.arch": "tiny-qwen3-moe", "model.warm_start": None, "rollout.prompts_per_step": 2,
            "rollout.samples_per_prompt": 2, "env.max_turns": 2, "env.max_new_tokens_per_turn": 24,
            "run.steps": 1, "run.progress": False}


def test_routing_replay_in_the_loop(tmp_path):
    cfg = load_config("tiny-cpu", {**TINY_RUN, "algo.routing_replay": True, "run.run_dir": str(tmp_path)})
    (record,) = train(cfg)  # the trainer refuses trajectories without routed experts, so they had them
    assert record["failed"] == 0 and record["sampled_tokens"] > 0
    assert record["train/logprob_mismatch_max"] < 1e-4


def test_true_on_policy_in_the_loop_is_bitwise(tmp_path):
    cfg = load_config("tiny-cpu", {**TINY_RUN, "algo.true_on_policy": True, "run.run_dir": str(tmp_path)})
    (record,) = train(cfg)
    assert record["failed"] == 0 and record["sampled_tokens"] > 0
    assert record["train/logprob_mismatch_max"] == 0.0  # every sampled token, every turn
