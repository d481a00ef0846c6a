"""Estimators chosen by name, and the batch builder between rollout and the policy step."""

from __future__ import annotations

import math

import pytest

from miles_agent.algorithms.batch_builder import BatchBuilder, token_kl
from miles_agent.algorithms.estimators import ESTIMATORS, check_estimator, estimate
from miles_agent.config import AlgoConfig, load_config
from miles_agent.errors import UserError
from miles_agent.types import Trajectory


def traj(reward: float, group: str, logprobs: tuple[float, ...] = (-0.5, -1.0)) -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2], group_id=group, reward=reward)
    t.append_model([3], [logprobs[0]], weight_version=0, turn=0)
    t.append_observation([4], turn=0)
    t.append_model([5], [logprobs[1]], weight_version=0, turn=1)
    return t.validate()


def test_unknown_estimator_lists_every_valid_name() -> None:
    with pytest.raises(UserError) as e:
        check_estimator(AlgoConfig(advantage="ppo"))
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"):
        assert name in str(e.value) and name in ESTIMATORS
    assert "algo.advantage" in str(e.value)
    cfg = load_config(None, {"algo.advantage": "reinforce++"})
    with pytest.raises(UserError, match="reinforce_pp_baseline"):
        check_estimator(cfg.algo)


def test_options_the_driver_cannot_honour_fail_early() -> None:
    with pytest.raises(UserError, match="kl_reward_coef"):
        check_estimator(AlgoConfig(advantage="grpo", kl_reward_coef=0.1))
    with pytest.raises(UserError, match="gamma"):
        check_estimator(AlgoConfig(advantage="gae", gamma=1.5))
    check_estimator(AlgoConfig(advantage="reinforce_pp", kl_reward_coef=0.1))
    with pytest.raises(UserError, match="samples_per_prompt >= 2"):
        check_estimator(AlgoConfig(dynamic_sampling=True), samples_per_prompt=1)
    with pytest.raises(UserError, match="max_rounds"):
        check_estimator(AlgoConfig(dynamic_sampling=True, dynamic_sampling_max_rounds=0))


def test_estimate_dispatches_by_name() -> None:
    trajs = [traj(1.0, "g"), traj(0.0, "g"), traj(2.0, "h")]
    adv, ret = estimate(AlgoConfig(advantage="grpo", normalize_std=False), trajs)
    assert adv == [[0.5] * 3, [-0.5] * 3, [0.0] * 3] and ret is None
    adv, ret = estimate(AlgoConfig(advantage="reinforce_pp_baseline"), trajs)
    assert ret == [[0.5, 0.0, 0.5], [-0.5, 0.0, -0.5], [0.0, 0.0, 0.0]]
    adv, ret = estimate(AlgoConfig(advantage="gae", gamma=1.0, gae_lambda=1.0), trajs,
                        values=[[0.0, 0.0, 0.5]] * 3)
    assert ret == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.0, 2.0]]
    with pytest.raises(ValueError, match="critic"):
        estimate(AlgoConfig(advantage="gae"), trajs)


class FakeTrainer:
    """Answers logprob queries like the FSDP2 trainer: reference = rollout - 0.25 per token."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def compute_logprobs(self, trajectories: list[Trajectory], reference: bool = False) -> list[list[float]]:
        self.calls.append(reference)
        shift = -0.25 if reference else 0.0
        return [[lp + shift if lp else 0.0 for lp in t.rollout_logprobs] for t in trajectories]


class FakeCritic:
    def __init__(self) -> None:
        self.trained: list[tuple[list[list[float]], list[list[float]]]] = []

    def values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        return [[0.25] * t.response_length for t in trajectories]

    def train_step(self, trajectories, returns, old_values) -> dict[str, float]:
        self.trained.append((returns, old_values))
        return {"value_loss": 1.0}


def test_batch_builder_folds_kl_into_rewards_with_the_reference_logprobs() -> None:
    trajs = [traj(1.0, "g"), traj(0.0, "g")]
    trainer = FakeTrainer()
    algo = AlgoConfig(advantage="reinforce_pp", kl_reward_coef=0.5, kl_estimator="k1")
    batch, metrics = BatchBuilder(algo, trainer).build(trajs)
    assert trainer.calls == [True]  # rollout logprobs are the old policy: only the reference is computed
    assert batch.ref_logprobs == [[-0.75, 0.0, -1.25]] * 2 and batch.old_logprobs is None
    # k1 = old - ref = 0.25 per model token: rewards -0.125 per token, returns (r - 0.25, 0, r - 0.125)
    vals = [0.75, 0.875, -0.25, -0.125]
    mean = sum(vals) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4)
    assert batch.advantages[0][0] == pytest.approx((0.75 - mean) / (std + 1e-6))
    assert batch.advantages[1][2] == pytest.approx((-0.125 - mean) / (std + 1e-6))
    assert metrics["adv/mean"] == pytest.approx(0.0, abs=1e-6)
    assert token_kl([[-1.0]], [[-2.0]], "k3") == [[pytest.approx(math.exp(-1) + 1 - 1)]]


def test_batch_builder_steps_the_critic_on_gae_returns() -> None:
    trajs = [traj(1.0, "g"), traj(0.0, "g")]
    critic = FakeCritic()
    algo = AlgoConfig(advantage="gae", gamma=1.0, gae_lambda=1.0, use_rollout_logprobs=False)
    batch, metrics = BatchBuilder(algo, FakeTrainer(), critic).build(trajs)
    (returns, old_values), = critic.trained
    assert returns == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]] and old_values == [[0.25] * 3] * 2
    assert metrics["critic/value_loss"] == 1.0
    assert batch.old_logprobs is None  # no KL in the reward: the trainer computes its own old logprobs
    with pytest.raises(ValueError, match="needs a critic"):
        BatchBuilder(algo, FakeTrainer())
