"""Every training option the FSDP2 trainer has, the Megatron trainer computes the same way: several
optimizer steps per batch, mismatch corrections, KL to a reference model (loss term and reward), and
group-level loss aggregation give the same metrics and the same updated weights on the same batch."""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import (
    advantages,
    assert_same_metrics,
    assert_same_weights,
    near_rollout_logprobs,
    trainer_pair,
    trajectories,
)

from miles_agent.algorithms.batch_builder import BatchBuilder
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch

# adam_eps=1 keeps Adam's steps proportional to the gradient (with a tiny eps a step is ~sign(g), which
# turns float noise in near-zero gradients into full-size differences).
TRAIN = dict(lr=0.1, adam_eps=1.0, micro_batch_tokens=24)
CORRECTION = dict(use_rollout_logprobs=False, mismatch_low=0.8, mismatch_high=1.25)

CASES = {
    # two mini-batches, two epochs: 4 optimizer steps, the ratio leaves 1 and the clip binds
    "mini_batches_x_epochs": ("tiny-qwen3", dict(mini_batches=2, ppo_epochs=2), dict(use_rollout_logprobs=False)),
    "mini_batches_moe": ("tiny-qwen3-moe", dict(mini_batches=2), dict(entropy_coef=0.01)),
    "tis": ("tiny-qwen3", dict(mini_batches=2), dict(mismatch_correction="tis", **CORRECTION)),
    "mis_geometric_veto": ("tiny-qwen3", {}, dict(mismatch_correction="mis", mismatch_level="geometric",
                                                  mismatch_veto=0.65, **CORRECTION)),
    "icepop_moe": ("tiny-qwen3-moe", {}, dict(mismatch_correction="icepop", **CORRECTION)),
    "kl_coef": ("tiny-qwen3", dict(mini_batches=2), dict(kl_coef=0.5, kl_estimator="k2")),
    "group_mean_token_mean_moe": ("tiny-qwen3-moe", dict(mini_batches=2), dict(loss_agg="group_mean_token_mean")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_option_gives_the_fsdp2_step(case):
    arch, train_kw, algo_kw = CASES[case]
    algo = AlgoConfig(**algo_kw)
    trajs = trajectories()
    with trainer_pair(arch, TrainConfig(**TRAIN, **train_kw), algo) as (fsdp, meg):
        if algo.mismatch_correction != "none":
            near_rollout_logprobs(trajs, fsdp.compute_logprobs(trajs))
        batch = TrainBatch(trajs, advantages(trajs))
        want, got = fsdp.train_step(batch), meg.train_step(batch)
        assert_same_metrics(got, want)
        assert_same_weights(dict(meg.named_weights()), dict(fsdp.named_weights()),
                            build_tiny(arch, seed=3)[0].state_dict())
    assert got["optimizer_steps"] == train_kw.get("mini_batches", 1) * train_kw.get("ppo_epochs", 1)
    if algo.mismatch_correction != "none":  # the correction really kept some tokens and dropped or cut others
        assert got["mismatch_out_of_range"] > 0 and got["mismatch_weight_mean"] != pytest.approx(1.0)
        if algo.mismatch_correction == "tis":
            assert got["mismatch_weight_mean"] < 1 and got["mismatch_masked_frac"] == 0
        else:
            assert 0 < got["mismatch_masked_frac"] < 1
    if algo.kl_coef > 0:  # the second step moved away from the reference: the KL term counts
        assert got["kl"] > 0


def test_kl_reward_reference_logprobs_match_fsdp2():
    """kl_reward_coef: the driver asks the trainer for reference logprobs; after an update they are still
    the initial policy's, the same as FSDP2's, and the KL-shaped advantages and the step agree."""
    algo = AlgoConfig(advantage="reinforce_pp_baseline", kl_reward_coef=0.2, kl_coef=0.1,
                      use_rollout_logprobs=False)
    trajs = trajectories()
    with trainer_pair("tiny-qwen3", TrainConfig(**TRAIN), algo) as (fsdp, meg):
        initial = meg.compute_logprobs(trajs)
        for t in (fsdp, meg):
            t.train_step(TrainBatch(trajs, advantages(trajs)))
        meg.offload()  # colocation: the reference model leaves the device with the policy, and comes back
        assert all(p.untyped_storage().nbytes() == 0 for p in meg.ref_model.parameters())
        meg.reload()
        ref = meg.compute_logprobs(trajs, reference=True)
        for a, b, c in zip(ref, fsdp.compute_logprobs(trajs, reference=True), initial):
            assert a == pytest.approx(b, abs=2e-5) and a == c
        assert max(abs(x - y) for a, b in zip(meg.compute_logprobs(trajs), ref) for x, y in zip(a, b)) > 1e-2
        (b1, _), (b2, _) = BatchBuilder(algo, fsdp).build(trajs), BatchBuilder(algo, meg).build(trajs)
        for x, y in zip(b2.advantages, b1.advantages):
            assert x == pytest.approx(y, abs=2e-5)
        assert_same_metrics(meg.train_step(b2), fsdp.train_step(b1))
        assert_same_weights(dict(meg.named_weights()), dict(fsdp.named_weights()),
                            build_tiny("tiny-qwen3", seed=3)[0].state_dict())


def test_reference_logprobs_without_a_reference_are_refused():
    with trainer_pair("tiny-qwen3", TrainConfig(**TRAIN), AlgoConfig()) as (_, meg):
        with pytest.raises(ValueError, match="kl_reward_coef"):
            meg.compute_logprobs(trajectories(), reference=True)
        assert meg.ref_model is None


def test_unsupported_consistency_modes_are_refused():
    from miles_agent.errors import UserError
    from miles_agent.trainers.megatron.trainer import MegatronTrainer

    model, tok = build_tiny("tiny-qwen3", seed=0)
    with pytest.raises(UserError, match="routing_replay"):
        MegatronTrainer(model, tok, TrainConfig(), AlgoConfig(routing_replay=True))
    with pytest.raises(UserError, match="use_rollout_logprobs=false"):
        MegatronTrainer(model, tok, TrainConfig(), AlgoConfig(mismatch_correction="tis"))
    assert not torch.distributed.is_initialized()


def test_distillation_loss_term_matches_fsdp2():
    """Teacher logprobs in the batch (on-policy distillation, loss mode) add the same reverse-KL term."""
    algo = AlgoConfig(distill_coef=0.5)
    trajs = trajectories()
    teacher = [[lp - 0.3 * (j % 3) for j, lp in enumerate(t.rollout_logprobs)] for t in trajs]
    with trainer_pair("tiny-qwen3-moe", TrainConfig(**TRAIN), algo) as (fsdp, meg):
        batch = TrainBatch(trajs, advantages(trajs), teacher_logprobs=teacher)
        want, got = fsdp.train_step(batch), meg.train_step(batch)
        assert_same_metrics(got, want)
        assert_same_weights(dict(meg.named_weights()), dict(fsdp.named_weights()),
                            build_tiny("tiny-qwen3-moe", seed=3)[0].state_dict())
    assert got["distill_loss"] != 0 and got["loss"] == pytest.approx(got["pg_loss"] + got["distill_loss"])
