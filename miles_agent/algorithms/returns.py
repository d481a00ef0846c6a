"""Token-level estimators: REINFORCE++ (and its -baseline variant) and GAE for PPO with a critic.

Pure functions over per-trajectory lists aligned with ``Trajectory.loss_mask`` (one entry per
response token). The recursions run over the *trainable* positions only, in order: the tokens an
environment inserted between two turns are part of the transition from one model token to the
next, not actions, so they carry no reward, value or advantage (they get 0.0).

The outcome reward lands on the last trainable token. With ``kl_coef > 0`` each trainable token
also gets ``-kl_coef * kl_t`` (KL to the reference folded into the reward, as in RLHF-PPO and
REINFORCE++), where ``kl_t`` is a per-token estimate chosen by ``algo.kl_estimator``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from miles_agent.algorithms.advantages import grpo

Rows = list[list[float]]


def _positions(mask: Sequence[int]) -> list[int]:
    return [i for i, m in enumerate(mask) if m]


def _check_rows(name: str, rows: Sequence[Sequence[float]] | None, masks: Sequence[Sequence[int]]) -> None:
    if rows is None:
        return
    if len(rows) != len(masks):
        raise ValueError(f"{len(rows)} {name} rows for {len(masks)} trajectories")
    for i, (r, m) in enumerate(zip(rows, masks)):
        if len(r) != len(m):
            raise ValueError(f"trajectory {i}: {len(r)} {name} values for {len(m)} response tokens")


def token_rewards(reward: float, mask: Sequence[int], kl: Sequence[float] | None = None,
                  kl_coef: float = 0.0) -> list[float]:
    """``r_t = -kl_coef * kl_t`` on trainable tokens, plus the outcome ``reward`` on the last one."""
    out = [0.0] * len(mask)
    pos = _positions(mask)
    if kl is not None and kl_coef:
        for p in pos:
            out[p] = -kl_coef * float(kl[p])
    if pos:
        out[pos[-1]] += float(reward)
    return out


def discounted_returns(token_reward: Sequence[float], mask: Sequence[int], gamma: float = 1.0) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}`` over the trainable positions (0.0 elsewhere)."""
    out = [0.0] * len(mask)
    running = 0.0
    for p in reversed(_positions(mask)):
        running = float(token_reward[p]) + gamma * running
        out[p] = running
    return out


def whiten(rows: Sequence[Sequence[float]], masks: Sequence[Sequence[int]], eps: float = 1e-6) -> Rows:
    """``(x - mean) / (std + eps)`` with mean and population std over every trainable token of the batch."""
    vals = [float(v) for r, m in zip(rows, masks) for v, k in zip(r, m) if k]
    if not vals:
        return [[0.0] * len(r) for r in rows]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return [[(float(v) - mean) / (std + eps) if k else 0.0 for v, k in zip(r, m)] for r, m in zip(rows, masks)]


def reinforce_pp(rewards: Sequence[float], masks: Sequence[Sequence[int]], *, group_ids: Sequence[Hashable] = (),
                 episode_ids: Sequence[Hashable] | None = None, baseline: bool = False,
                 kl: Sequence[Sequence[float]] | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                 eps: float = 1e-6) -> tuple[Rows, Rows]:
    """REINFORCE++ (Hu et al. 2025): per-token rewards (KL folded in), discounted returns, then the
    returns whitened over the global batch. ``baseline=True`` is REINFORCE++-baseline: the group mean
    reward (episode-aware, uneven groups allowed) is subtracted from each outcome first.

    Returns ``(advantages, returns)``; the returns are the un-whitened ``G_t``.
    """
    if len(rewards) != len(masks):
        raise ValueError(f"{len(rewards)} rewards for {len(masks)} trajectories")
    _check_rows("kl", kl, masks)
    outcome = list(rewards)
    if baseline:
        outcome = grpo(rewards, list(group_ids), normalize_std=False, eps=eps, episode_ids=episode_ids)
    returns = [discounted_returns(token_rewards(r, m, None if kl is None else kl[i], kl_coef), m, gamma)
               for i, (r, m) in enumerate(zip(outcome, masks))]
    return whiten(returns, masks, eps), returns


def gae(rewards: Sequence[float], masks: Sequence[Sequence[int]], values: Sequence[Sequence[float]], *,
        kl: Sequence[Sequence[float]] | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
        lam: float = 0.95, whiten_advantages: bool = True, eps: float = 1e-6) -> tuple[Rows, Rows]:
    """Generalized advantage estimation (Schulman et al. 2016) with a learned value per token:
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` after the last token is 0: the episode ended),
    ``A_t = delta_t + gamma * lam * A_{t+1}``, returns ``A_t + V_t`` (the critic's targets).

    Advantages are whitened over the batch's trainable tokens (as PPO implementations do) unless
    ``whiten_advantages`` is False. Returns ``(advantages, returns)``.
    """
    if len(rewards) != len(masks):
        raise ValueError(f"{len(rewards)} rewards for {len(masks)} trajectories")
    _check_rows("value", values, masks)
    _check_rows("kl", kl, masks)
    advs: Rows = []
    rets: Rows = []
    for i, (reward, mask) in enumerate(zip(rewards, masks)):
        r = token_rewards(reward, mask, None if kl is None else kl[i], kl_coef)
        v = values[i]
        a, ret = [0.0] * len(mask), [0.0] * len(mask)
        running, next_v = 0.0, 0.0
        for p in reversed(_positions(mask)):
            delta = r[p] + gamma * next_v - float(v[p])
            running = delta + gamma * lam * running
            a[p], ret[p] = running, running + float(v[p])
            next_v = float(v[p])
        advs.append(a)
        rets.append(ret)
    return (whiten(advs, masks, eps) if whiten_advantages else advs), rets
