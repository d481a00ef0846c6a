"""Advantage estimators on uneven groups, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from miles_agent.algorithms.advantages import (
    ADVANTAGES,
    get_advantage_fn,
    grpo,
    per_token,
    rloo,
)
from miles_agent.algorithms.estimators import estimate
from miles_agent.config import AlgoConfig
from miles_agent.errors import UserError
from miles_agent.types import Trajectory

# group a has 3 samples (rewards 1, 0, 2), group b one (5), group c two (0, 1), interleaved
IDS = ["a", "b", "c", "a", "c", "a"]
REWARDS = [1.0, 5.0, 0.0, 0.0, 1.0, 2.0]


def test_grpo_uneven_groups_population_std() -> None:
    std_a = math.sqrt(2 / 3)  # population std of (1, 0, 2)
    want = [0.0, 0.0, -0.5 / (0.5 + 1e-6), -1 / (std_a + 1e-6), 0.5 / (0.5 + 1e-6), 1 / (std_a + 1e-6)]
    assert grpo(REWARDS, IDS) == pytest.approx(want, abs=1e-12)
    assert grpo(REWARDS, IDS)[3] == pytest.approx(-1.2247449, abs=1e-5)


def test_dr_grpo_is_mean_centering_only() -> None:
    want = [0.0, 0.0, -0.5, -1.0, 0.5, 1.0]
    assert grpo(REWARDS, IDS, normalize_std=False) == pytest.approx(want)
    assert get_advantage_fn("dr_grpo")(REWARDS, IDS) == pytest.approx(want)


def test_group_of_one_and_constant_group_get_zero() -> None:
    assert grpo([3.0], ["x"]) == [0.0]
    assert grpo([1.0, 1.0, 1.0], ["g"] * 3) == [0.0, 0.0, 0.0]


def test_rloo_leave_one_out_baseline() -> None:
    # a: 1 - (0+2)/2 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5; c: -1, 1; b alone: 0
    assert rloo(REWARDS, IDS) == pytest.approx([0.0, 0.0, -1.0, -1.5, 1.0, 1.5])


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="group ids"):
        grpo([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="finite reward"):
        grpo([1.0, None], ["a", "a"])  # type: ignore[list-item]
    with pytest.raises(UserError, match="grpo"):
        get_advantage_fn("gae")
    assert set(ADVANTAGES) >= {"grpo", "dr_grpo", "rloo"}


def _traj(reward: float, group: str) -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2], group_id=group, reward=reward)
    t.append_model([3, 4], [-0.1, -0.2], weight_version=0, turn=0)
    t.append_observation([5], turn=0)
    t.append_model([6], [-0.3], weight_version=0, turn=1)
    return t


def _grpo_rows(trajs: list[Trajectory]) -> list[list[float]]:
    """Per-token GRPO advantages as the loop computes them (algorithms/estimators.estimate)."""
    return estimate(AlgoConfig(advantage="grpo", normalize_std=False), trajs)[0]


def test_per_token_broadcasts_over_every_response_position() -> None:
    trajs = [_traj(1.0, "g"), _traj(0.0, "g"), _traj(7.0, "h")]
    adv = [row[0] for row in _grpo_rows(trajs)]
    assert adv == pytest.approx([0.5, -0.5, 0.0])
    rows = per_token(trajs, adv)
    assert rows == [[0.5] * 4, [-0.5] * 4, [0.0] * 4]
    assert _grpo_rows(trajs) == rows
    with pytest.raises(ValueError):
        per_token(trajs, adv[:2])


# -- one episode, several trajectories (branches) -------------------------------------------------

def test_branches_of_one_episode_count_once_and_share_its_advantage() -> None:
    # group a: episode e1 has two branches (rewards 1 and 1), e2 has 0, e3 has 2; group b: f1 (3), f2 (1)
    rewards = [1.0, 1.0, 0.0, 2.0, 3.0, 1.0]
    groups = ["a", "a", "a", "a", "b", "b"]
    episodes = ["e1", "e1", "e2", "e3", "f1", "f2"]
    adv = grpo(rewards, groups, normalize_std=False, episode_ids=episodes)
    # a's episode rewards (1, 0, 2): mean 1 -> e1 (both branches) 0, e2 -1, e3 +1; b: mean 2 -> +1, -1
    assert adv == pytest.approx([0.0, 0.0, -1.0, 1.0, 1.0, -1.0])
    std_a = math.sqrt(2 / 3)
    normed = grpo(rewards, groups, episode_ids=episodes)
    assert normed[:4] == pytest.approx([0.0, 0.0, -1 / (std_a + 1e-6), 1 / (std_a + 1e-6)])


def test_branch_rewards_are_averaged_per_episode() -> None:
    # e1's branches scored 1 and 0 -> the episode counts once with 0.5; e2 scored 0, e3 scored 1
    rewards, groups = [1.0, 0.0, 0.0, 1.0], ["g"] * 4
    episodes = ["e1", "e1", "e2", "e3"]
    mean = (0.5 + 0.0 + 1.0) / 3
    assert grpo(rewards, groups, normalize_std=False, episode_ids=episodes) == pytest.approx(
        [0.5 - mean, 0.5 - mean, -mean, 1.0 - mean])
    # without episode ids each branch is a sample: mean of the 4 rewards is 0.5
    assert grpo(rewards, groups, normalize_std=False) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # RLOO over episodes: e1 = 0.5 - (0 + 1)/2 = 0, e2 = 0 - 0.75, e3 = 1 - 0.25
    assert rloo(rewards, groups, episode_ids=episodes) == pytest.approx([0.0, 0.0, -0.75, 0.75])


def test_the_estimator_uses_the_trajectory_episode_id() -> None:
    a, b, c = _traj(1.0, "g"), _traj(1.0, "g"), _traj(0.0, "g")
    b.episode_id = a.episode_id  # b is a branch of a's episode
    assert c.episode_id == c.uid  # the default: its own episode
    assert [row[0] for row in _grpo_rows([a, b, c])] == pytest.approx([0.5, 0.5, -0.5])
    with pytest.raises(ValueError, match="episode ids"):
        grpo([1.0, 0.0], ["g", "g"], episode_ids=["x"])
