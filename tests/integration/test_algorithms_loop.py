"""The algorithm options end to end through ``miles_agent.loop.train`` on the tiny model."""

from __future__ import annotations

import math

from miles_agent.config import load_config
from miles_agent.loop import train

# The shipped arith-tools warm start answers some tasks right, so groups have reward variance.
SMALL = {"model.warm_start": "builtin", "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 4,
         "env.max_new_tokens_per_turn": 40, "run.progress": False}


def test_ppo_with_critic_mini_batches_and_dynamic_sampling(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.steps": 2, "run.run_dir": str(tmp_path), "train.lr": 3e-4,
                                   "algo.advantage": "gae", "algo.critic_lr": 1e-3, "train.mini_batches": 2,
                                   "algo.dynamic_sampling": True, "algo.dynamic_sampling_max_rounds": 3})
    records = train(cfg)
    assert len(records) == 2
    for r in records:
        for k in ("train/loss", "train/pg_loss", "critic/value_loss", "critic/value_grad_norm", "train/grad_norm"):
            assert math.isfinite(r[k]), (k, r[k])
        assert r["train/optimizer_steps"] == 2 and r["train/mini_batches"] == 2
        # every group trained on was informative, or forced in after the rejection budget ran out
        assert r["dynamic_sampling/kept_groups"] + r["dynamic_sampling/forced_groups"] >= 1
        assert r["train/logprob_mismatch_mean"] < 1e-3  # measured on the first, pre-update mini-batch
    assert max(r["train/clipfrac"] for r in records) > 0  # the second optimizer step sees a moved policy
    assert (tmp_path / "checkpoints" / "step_2" / "critic").is_dir()  # the critic is checkpointed too


def test_reinforce_pp_baseline_gspo_with_kl_reward_and_tis(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.steps": 1, "run.run_dir": str(tmp_path),
                                   "algo.advantage": "reinforce_pp_baseline", "algo.kl_reward_coef": 0.01,
                                   "algo.kl_estimator": "k1", "algo.loss": "gspo", "algo.clip_eps": 3e-4,
                                   "algo.clip_eps_high": 4e-4, "algo.loss_agg": "group_mean_token_mean",
                                   "algo.use_rollout_logprobs": False, "algo.mismatch_correction": "tis"})
    (r,) = train(cfg)
    for k in ("train/loss", "train/pg_loss", "train/mismatch_weight_mean", "train/mismatch_k3", "adv/abs_mean"):
        assert math.isfinite(r[k]), (k, r[k])
    assert r["train/mismatch_weight_mean"] > 0.5  # engine and trainer agree: weights near 1
    assert "train/kl" in r  # the reference model exists for the KL folded into the reward
