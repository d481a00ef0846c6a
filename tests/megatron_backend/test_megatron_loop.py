"""The Megatron backend through the whole driver loop, with the options it used to refuse: the batch
builder asks it for reference logprobs (KL folded into the reward), and it takes two optimizer steps
with a mismatch correction and group-level aggregation."""

from __future__ import annotations

import math

from miles_agent.config import load_config
from miles_agent.loop import train


def test_loop_with_kl_reward_mini_batches_and_tis(tmp_path):
    cfg = load_config("tiny-cpu", {"model.warm_start": "builtin", "rollout.prompts_per_step": 2,
                                   "rollout.samples_per_prompt": 2, "env.max_new_tokens_per_turn": 24,
                                   "run.progress": False, "run.steps": 1, "run.run_dir": str(tmp_path),
                                   "train.backend": "megatron", "train.mini_batches": 2,
                                   "algo.advantage": "reinforce_pp_baseline", "algo.kl_reward_coef": 0.01,
                                   "algo.kl_coef": 0.01, "algo.loss_agg": "group_mean_token_mean",
                                   "algo.use_rollout_logprobs": False, "algo.mismatch_correction": "tis"})
    (r,) = train(cfg)
    for k in ("train/loss", "train/pg_loss", "train/kl", "train/mismatch_weight_mean", "train/grad_norm"):
        assert math.isfinite(r[k]), (k, r[k])
    assert r["train/optimizer_steps"] == 2 and r["train/mini_batches"] == 2
    assert r["train/mismatch_weight_mean"] > 0.5  # engine and Megatron trainer agree: weights near 1
    assert r["train/logprob_mismatch_mean"] < 1e-2
    assert (tmp_path / "checkpoints" / "step_1").is_dir()
