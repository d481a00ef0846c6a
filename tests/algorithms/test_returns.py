"""REINFORCE++, REINFORCE++-baseline and GAE against values computed by hand."""

from __future__ import annotations

import math

import pytest

from miles_agent.algorithms.returns import discounted_returns, gae, reinforce_pp, token_rewards, whiten

# trajectory 0: two model tokens, one observation token, one model token; trajectory 1: two model tokens
MASKS = [[1, 1, 0, 1], [1, 1]]


def flat(rows: list[list[float]]) -> list[float]:
    return [v for r in rows for v in r]


def test_token_rewards_put_the_outcome_on_the_last_trainable_token() -> None:
    assert token_rewards(2.0, [1, 1, 0, 1, 0]) == [0.0, 0.0, 0.0, 2.0, 0.0]
    assert token_rewards(2.0, [1, 1, 0, 1], kl=[0.1, 0.2, 9.0, 0.3], kl_coef=0.5) == pytest.approx(
        [-0.05, -0.1, 0.0, 2.0 - 0.15])
    assert token_rewards(1.0, [0, 0]) == [0.0, 0.0]


def test_discounted_returns_skip_observation_tokens() -> None:
    # trainable rewards (1, 0, 2) at positions 0, 1, 3; gamma 0.5: G3 = 2, G1 = 0 + 1 = 1, G0 = 1 + 0.5 = 1.5
    assert discounted_returns([1.0, 0.0, 7.0, 2.0], [1, 1, 0, 1], gamma=0.5) == pytest.approx([1.5, 1.0, 0.0, 2.0])


def test_whiten_uses_trainable_tokens_of_the_whole_batch() -> None:
    out = whiten([[1.0, 3.0, 100.0], [5.0]], [[1, 1, 0], [1]], eps=0.0)
    # values 1, 3, 5: mean 3, population std sqrt(8/3)
    s = math.sqrt(8 / 3)
    assert flat(out) == pytest.approx([-2 / s, 0.0, 0.0, 2 / s])


def test_reinforce_pp_folds_kl_then_whitens_globally() -> None:
    kl = [[0.2, 0.4, 0.0, 0.2], [0.0, 0.6]]
    adv, ret = reinforce_pp([1.0, 0.0], MASKS, kl=kl, kl_coef=0.5, gamma=1.0, eps=0.0)
    # per-token rewards: t0 = (-0.1, -0.2, -, 1 - 0.1), t1 = (0, -0.3); returns are suffix sums
    assert ret[0] == pytest.approx([0.6, 0.7, 0.0, 0.9])
    assert ret[1] == pytest.approx([-0.3, -0.3])
    vals = [0.6, 0.7, 0.9, -0.3, -0.3]
    mean = sum(vals) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 5)
    assert adv[0] == pytest.approx([(0.6 - mean) / std, (0.7 - mean) / std, 0.0, (0.9 - mean) / std])
    assert adv[1] == pytest.approx([(-0.3 - mean) / std] * 2)


def test_reinforce_pp_baseline_subtracts_the_group_mean_first_uneven_groups() -> None:
    # group a: rewards 1, 0, 2 (mean 1); group b: a lone sample (no baseline: 0)
    masks = [[1], [1], [1, 1], [1]]
    adv, ret = reinforce_pp([1.0, 0.0, 2.0, 5.0], masks, group_ids=["a", "a", "a", "b"], baseline=True,
                            gamma=1.0, eps=0.0)
    assert flat(ret) == pytest.approx([0.0, -1.0, 1.0, 1.0, 0.0])
    vals = [0.0, -1.0, 1.0, 1.0, 0.0]  # mean 0.2
    std = math.sqrt(sum((v - 0.2) ** 2 for v in vals) / 5)
    assert flat(adv) == pytest.approx([-0.2 / std, -1.2 / std, 0.8 / std, 0.8 / std, -0.2 / std])
    # branches: episode e1 has two trajectories (1 and 1), e2 scored 0 -> mean over episodes 0.5
    _, ret = reinforce_pp([1.0, 1.0, 0.0], [[1], [1], [1]], group_ids=["g"] * 3, episode_ids=["e1", "e1", "e2"],
                          baseline=True)
    assert flat(ret) == pytest.approx([0.5, 0.5, -0.5])


def test_gae_by_hand() -> None:
    values = [[0.5, 0.25, 9.0, 1.0]]
    adv, ret = gae([2.0], [[1, 1, 0, 1]], values, gamma=0.9, lam=0.5, whiten_advantages=False)
    # positions 0, 1, 3; rewards (0, 0, 2); V after the end = 0
    d3 = 2.0 + 0.9 * 0.0 - 1.0  # 1.0
    d1 = 0.0 + 0.9 * 1.0 - 0.25  # 0.65
    d0 = 0.0 + 0.9 * 0.25 - 0.5  # -0.275
    a3 = d3
    a1 = d1 + 0.45 * a3
    a0 = d0 + 0.45 * a1
    assert adv[0] == pytest.approx([a0, a1, 0.0, a3])
    assert ret[0] == pytest.approx([a0 + 0.5, a1 + 0.25, 0.0, a3 + 1.0])
    # lambda = 1, gamma = 1: advantages are return minus value (Monte-Carlo)
    adv, ret = gae([2.0], [[1, 1, 0, 1]], values, gamma=1.0, lam=1.0, whiten_advantages=False)
    assert adv[0] == pytest.approx([1.5, 1.75, 0.0, 1.0]) and ret[0] == pytest.approx([2.0, 2.0, 0.0, 2.0])
    # whitened over the batch's trainable tokens
    wadv, _ = gae([2.0], [[1, 1, 0, 1]], values, gamma=1.0, lam=1.0, eps=0.0)
    m = (1.5 + 1.75 + 1.0) / 3
    s = math.sqrt(((1.5 - m) ** 2 + (1.75 - m) ** 2 + (1.0 - m) ** 2) / 3)
    assert wadv[0] == pytest.approx([(1.5 - m) / s, (1.75 - m) / s, 0.0, (1.0 - m) / s])


def test_gae_kl_penalty_and_shape_errors() -> None:
    adv, ret = gae([1.0], [[1, 1]], [[0.0, 0.0]], kl=[[0.4, 0.2]], kl_coef=0.5, gamma=1.0, lam=1.0,
                   whiten_advantages=False)
    assert ret[0] == pytest.approx([-0.2 + 1.0 - 0.1, 1.0 - 0.1])
    with pytest.raises(ValueError, match="value values"):
        gae([1.0], [[1, 1]], [[0.0]])
    with pytest.raises(ValueError, match="rewards"):
        reinforce_pp([1.0, 2.0], [[1]])
