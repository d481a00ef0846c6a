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
    sample_advantages,
    token_advantages,
)
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


def test_per_token_broadcasts_over_every_response_position() -> None:
    trajs = [_traj(1.0, "g"), _traj(0.0, "g"), _traj(7.0, "h")]
    adv = sample_advantages(trajs, "grpo", normalize_std=False)
    assert adv == pytest.approx([0.5, -0.5, 0.0])
    rows = per_token(trajs, adv)
    assert rows == [[0.5] * 4, [-0.5] * 4, [0.0] * 4]
    assert token_advantages(trajs, "grpo", normalize_std=False) == rows
    with pytest.raises(ValueError):
        per_token(trajs, adv[:2])
