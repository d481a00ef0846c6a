"""Advantage estimators: small pure functions over per-sample rewards, chosen by name.

The driver computes advantages (trainers stay algorithm-blind): one scalar per sample from the
rewards of its group, then :func:`per_token` broadcasts it over the sample's response positions.

Groups are whatever ``group_ids`` says, and may be uneven in size: a group's statistics use only
its own members, never a fixed ``samples_per_prompt`` reshape (the uneven-group pitfall of
slime #1414 / #2230). A group of one has no baseline, so its advantage is 0.

One rollout may yield several trajectories (branches of one episode). With ``episode_ids`` those
count as *one* sample in their group's statistics (the episode's reward is the mean of its
trajectories' rewards) and every one of them gets the episode's advantage.

Token-level estimators (REINFORCE++, GAE) live in ``returns.py``; ``estimators.py`` names them all.

The module needs only the standard library, so environment workers can import it without torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence

from miles_agent.errors import UserError
from miles_agent.types import Trajectory

AdvantageFn = Callable[..., list[float]]


def _groups(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Sample indices per group, in first-seen order."""
    out: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


def check_rewards(rewards: Sequence[float], group_ids: Sequence[Hashable]) -> None:
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    for i, r in enumerate(rewards):
        if r is None or not math.isfinite(r):
            raise ValueError(f"reward of sample {i} is {r!r}; every trained sample needs a finite reward")


def per_episode(fn: AdvantageFn) -> AdvantageFn:
    """Make a per-sample estimator episode-aware: with ``episode_ids``, it runs on one sample per
    (group, episode) -- the mean reward of the episode's trajectories -- and each trajectory gets its
    episode's advantage. Without ``episode_ids`` every trajectory is its own episode."""

    @functools.wraps(fn)
    def wrapped(rewards: Sequence[float], group_ids: Sequence[Hashable], *args: object,
                episode_ids: Sequence[Hashable] | None = None, **kwargs: object) -> list[float]:
        check_rewards(rewards, group_ids)
        if episode_ids is None:
            return fn(rewards, group_ids, *args, **kwargs)
        if len(episode_ids) != len(rewards):
            raise ValueError(f"{len(rewards)} rewards but {len(episode_ids)} episode ids")
        members: dict[tuple[Hashable, Hashable], list[int]] = {}
        for i, key in enumerate(zip(group_ids, episode_ids)):
            members.setdefault(key, []).append(i)
        keys = list(members)
        ep_rewards = [sum(float(rewards[i]) for i in members[k]) / len(members[k]) for k in keys]
        ep_adv = fn(ep_rewards, [k[0] for k in keys], *args, **kwargs)
        adv = [0.0] * len(rewards)
        for k, a in zip(keys, ep_adv):
            for i in members[k]:
                adv[i] = a
        return adv

    return wrapped


@per_episode
def grpo(rewards: Sequence[float], group_ids: Sequence[Hashable], normalize_std: bool = True,
         eps: float = 1e-6) -> list[float]:
    """GRPO: ``(r - group mean) / (group std + eps)``; with ``normalize_std=False``, ``r - group mean``.

    The std is the *population* std (divide by n, not n - 1): it is defined for every group size and
    makes a group's normalized advantages have unit variance, whatever the size. Dividing by the std
    is what Dr.GRPO drops, because it up-weights groups that are almost all right or all wrong.
    """
    check_rewards(rewards, group_ids)
    adv = [0.0] * len(rewards)
    for idx in _groups(group_ids).values():
        if len(idx) < 2:
            continue  # no baseline from a lone sample: advantage 0
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i, v in zip(idx, vals):
            adv[i] = (v - mean) / (std + eps) if normalize_std else v - mean
    return adv


@per_episode
def dr_grpo(rewards: Sequence[float], group_ids: Sequence[Hashable], normalize_std: bool = False,
            eps: float = 1e-6) -> list[float]:
    """Dr.GRPO: the group mean as baseline, no std division (``normalize_std`` is ignored)."""
    return grpo(rewards, group_ids, normalize_std=False, eps=eps)


@per_episode
def rloo(rewards: Sequence[float], group_ids: Sequence[Hashable], normalize_std: bool = False,
         eps: float = 1e-6) -> list[float]:
    """REINFORCE leave-one-out: ``r - mean of the other members of the group`` (unbiased baseline).

    ``normalize_std`` and ``eps`` are accepted for a uniform signature and ignored.
    """
    check_rewards(rewards, group_ids)
    adv = [0.0] * len(rewards)
    for idx in _groups(group_ids).values():
        n = len(idx)
        if n < 2:
            continue
        total = sum(float(rewards[i]) for i in idx)
        for i in idx:
            adv[i] = float(rewards[i]) - (total - float(rewards[i])) / (n - 1)
    return adv


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered as ``name``, or a UserError listing the valid names."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise UserError(f"unknown advantage estimator {name!r}; choose one of: {', '.join(ADVANTAGES)} "
                        "(config key algo.advantage)") from None


def per_token(trajectories: Sequence[Trajectory], advantages: Sequence[float]) -> list[list[float]]:
    """Broadcast each sample's advantage over every response position.

    Every position gets the value, observation tokens included: the loss mask, not the advantage,
    decides what trains, so the two never have to agree.
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    return [[float(a)] * t.response_length for t, a in zip(trajectories, advantages)]
