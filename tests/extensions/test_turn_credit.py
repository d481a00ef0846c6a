"""Turn-level credit: per-turn rewards and a turn discount change which turn's tokens get credit; with
neither it is GRPO exactly. Overlong filtering masks or down-weights trajectories a length limit cut."""

from __future__ import annotations

import math

import pytest

from miles_agent.algorithms.estimators import estimate
from miles_agent.algorithms.turns import apply_overlong, turn_returns
from miles_agent.build import check_choices
from miles_agent.config import AlgoConfig, load_config
from miles_agent.errors import UserError
from miles_agent.types import Status, Trajectory


def two_turns(reward: float, turn_rewards: dict[int, float] | None = None, group: str = "g") -> Trajectory:
    """Model turn 0 (2 tokens), an observation (1 token), model turn 1 (2 tokens)."""
    t = Trajectory(prompt_ids=[1], group_id=group, reward=reward)
    t.append_model([5, 6], [-0.1, -0.1], weight_version=0, turn=0)
    t.append_observation([9], turn=0)
    t.append_model([7, 8], [-0.1, -0.1], weight_version=0, turn=1)
    t.reward_parts = {f"turn_reward/{k}": v for k, v in (turn_rewards or {}).items()}
    return t


def test_without_turn_rewards_and_no_discount_it_is_grpo():
    trajs = [two_turns(1.0), two_turns(0.0), two_turns(0.0)]
    plain, _ = estimate(AlgoConfig(advantage="grpo"), trajs)
    assert all(len(set(row)) == 1 for row in plain)  # one advantage per trajectory
    turned, _ = estimate(AlgoConfig(advantage="grpo", turn_discount=0.999999999), trajs)
    for a, b in zip(plain, turned):
        assert a == pytest.approx(b, abs=1e-6)


def test_a_turn_discount_gives_the_last_turn_more_credit_for_the_outcome():
    trajs = [two_turns(1.0), two_turns(0.0)]
    rows, _ = estimate(AlgoConfig(advantage="grpo", normalize_std=False, turn_discount=0.5), trajs)
    # returns: winner G1 = 1, G0 = 0.5; loser 0, 0; baseline = mean of G0 = 0.25
    assert rows[0] == pytest.approx([0.25, 0.25, 0.25, 0.75, 0.75])
    assert rows[1] == pytest.approx([-0.25, -0.25, -0.25, -0.25, -0.25])


def test_per_turn_rewards_credit_the_turn_that_earned_them():
    t = two_turns(0.0, {0: 1.0})
    assert turn_returns(t, 1.0) == {0: 1.0, 1: 0.0}
    rows, _ = estimate(AlgoConfig(advantage="grpo", normalize_std=False), [t, two_turns(0.0)])
    assert rows[0][:2] == pytest.approx([0.5, 0.5]) and rows[0][3:] == pytest.approx([-0.5, -0.5])
    rloo, _ = estimate(AlgoConfig(advantage="rloo"), [t, two_turns(0.0)])
    assert rloo[0][:2] == pytest.approx([1.0, 1.0])  # leave-one-out baseline: the other's return, 0


def test_overlong_trajectories_are_masked_or_downweighted():
    cut, done = two_turns(1.0), two_turns(0.0)
    cut.status = Status.TRUNCATED
    adv = [[1.0] * 5, [1.0] * 5]
    assert apply_overlong([cut, done], adv, "downweight", 0.25) == {"overlong/truncated": 1.0}
    assert adv == [[0.25] * 5, [1.0] * 5] and cut.loss_mask == [1, 1, 0, 1, 1]
    assert apply_overlong([cut, done], adv, "mask", 0.0) == {"overlong/truncated": 1.0}
    assert cut.loss_mask == [0] * 5 and done.loss_mask == [1, 1, 0, 1, 1]
    assert apply_overlong([cut], adv, "keep", 0.0) == {}


def test_bad_turn_options_fail_at_start():
    for overrides, needle in [({"algo.turn_discount": 1.5}, "algo.turn_discount=1.5 is out of range: it must be >= 0 and <= 1"),
                              ({"algo.overlong": "drop"}, "algo.overlong='drop': choose one of keep, mask, downweight")]:
        with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            check_choices(load_config("tiny-cpu", overrides))
    assert math.isclose(AlgoConfig().turn_discount, 1.0)
