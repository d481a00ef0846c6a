"""Several optimizer steps per rollout batch, mismatch corrections in the trainer, and the critic."""

from __future__ import annotations

import math

import pytest

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.critic import CriticTrainer, ValueModel
from miles_agent.trainers.minibatch import split_mini_batches
from tests.trainers.test_fsdp2_trainer import constant_advantages, make_trainer, make_trajectories


def test_split_keeps_groups_together_and_balances_counts() -> None:
    groups = ["b", "a", "b", "a", "c", "a"]
    assert split_mini_batches(groups, 2) == [[0, 2, 1], [3, 5, 4]]  # b b a | a a c
    assert split_mini_batches(groups, 1) == [[0, 2, 1, 3, 5, 4]]
    assert split_mini_batches(["g"] * 3, 10) == [[0], [1], [2]]  # never an empty step


def test_mini_batches_make_the_clip_bind() -> None:
    results = {}
    for n in (1, 2):
        trainer = make_trainer(lr=3e-2, mini_batches=n, ppo_epochs=2)
        trajs = make_trajectories(trainer)
        results[n] = trainer.train_step(constant_advantages(trajs, [1.0, -1.0, 1.0, -1.0]))
    one, two = results[1], results[2]
    assert one["optimizer_steps"] == 2 and two["optimizer_steps"] == 4 and two["mini_batches"] == 2
    # after the first optimizer step the policy is no longer the one that sampled: ratios leave [0.8, 1.2]
    assert two["clipfrac"] > 0 and one["clipfrac"] > 0
    assert two["approx_kl"] > 0
    # the mismatch is measured only where the trainer's pre-update logprobs are known (first step)
    assert two["logprob_mismatch_max"] < 1e-5
    single = make_trainer(lr=3e-2)
    trajs = make_trajectories(single)
    assert single.train_step(constant_advantages(trajs, [1.0, -1.0, 1.0, -1.0]))["clipfrac"] == 0.0


def test_tis_weights_and_mismatch_metrics_in_the_trainer() -> None:
    trainer = make_trainer(use_rollout_logprobs=False, mismatch_correction="tis", mismatch_high=1.2)
    trajs = make_trajectories(trainer)
    shift = [0.5, -0.5, 0.1, 0.0]  # rollout logprob = trainer's - shift, so w = exp(shift)
    for t, s in zip(trajs, shift):
        t.rollout_logprobs = [lp - s if m else lp for lp, m in zip(t.rollout_logprobs, t.loss_mask)]
    m = trainer.train_step(constant_advantages(trajs, [1.0, -1.0, 1.0, -1.0]))
    n = [sum(t.loss_mask) for t in trajs]
    tokens = sum(n)
    assert m["logprob_mismatch_mean"] == pytest.approx(sum(abs(s) * k for s, k in zip(shift, n)) / tokens, abs=1e-4)
    assert m["logprob_mismatch_max"] == pytest.approx(0.5, abs=1e-4)
    assert m["mismatch_k1"] == pytest.approx(sum(-s * k for s, k in zip(shift, n)) / tokens, abs=1e-4)
    assert m["mismatch_out_of_range"] == pytest.approx(n[0] / tokens)  # w = e^0.5 is outside [0.5, 1.2]
    want_w = sum(min(math.exp(s), 1.2) * k for s, k in zip(shift, n)) / tokens
    assert m["mismatch_weight_mean"] == pytest.approx(want_w, abs=1e-4)
    assert m["mismatch_masked_frac"] == 0.0


def test_given_old_and_reference_logprobs_are_used_as_is() -> None:
    trainer = make_trainer(use_rollout_logprobs=False, kl_coef=0.1)
    trajs = make_trajectories(trainer)
    old = trainer.compute_logprobs(trajs)
    shifted = [[lp - 0.1 if m else lp for lp, m in zip(row, t.loss_mask)] for row, t in zip(old, trajs)]
    batch = TrainBatch(trajs, [[0.0] * t.response_length for t in trajs], old_logprobs=shifted,
                       ref_logprobs=shifted)
    m = trainer.train_step(batch)
    # current - old = 0.1 per token: k3 = exp(-0.1) + 0.1 - 1
    assert m["approx_kl"] == pytest.approx(math.exp(-0.1) + 0.1 - 1, abs=1e-5)
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainBatch(trajs, batch.advantages, old_logprobs=shifted[:2])


def test_value_loss_decreases_on_a_fixed_batch() -> None:
    policy = make_trainer()  # owns the process group the critic joins
    trajs = make_trajectories()
    model, tok = build_tiny("tiny-qwen3", seed=0)
    critic = CriticTrainer(ValueModel(model), TrainConfig(mini_batches=2), AlgoConfig(critic_lr=1e-2, value_clip=0.5))
    values = critic.values(trajs)
    assert all(v == 0.0 for row in values for v in row)  # a zero head: V = 0 before training
    returns = [[t.reward * m for m in t.loss_mask] for t in trajs]  # 0 or 1 on trainable tokens
    losses, clipfracs = [], []
    for _ in range(6):
        old = critic.values(trajs)
        out = critic.train_step(trajs, returns, old)
        losses.append(out["value_loss"])
        clipfracs.append(out["value_clipfrac"])
        assert all(math.isfinite(v) for v in out.values())
    assert losses[-1] < 0.5 * losses[0]
    assert critic.step == 12  # 2 mini-batches x 6 calls
    fitted = [sum(v for v, m in zip(row, t.loss_mask) if m) / sum(t.loss_mask)
              for row, t in zip(critic.values(trajs), trajs)]
    assert min(fitted[1], fitted[3]) > max(fitted[0], fitted[2])  # rewards are 0, 1, 0, 1
    policy.close()
