"""Turn-level credit for multi-turn agents, and overlong filtering.

An environment that rewards turns puts them in ``Reward.parts`` as ``turn_reward/<k>`` (k = the turn
index of the harness's spans); the trajectory's ``reward`` stays the outcome, credited to its last turn.
A token of turn k gets the discounted return from that turn on, ``G_k = sum_{j>=k} gamma^(j-k) r_j``
(``gamma = algo.turn_discount``), minus its group's baseline of episode returns ``G_first`` (the mean,
or the leave-one-out mean for ``rloo``), divided by the group's std for ``grpo``. With no turn rewards
and ``gamma = 1`` every ``G_k`` is the outcome and this is the per-sample estimator exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles_agent.types import SpanKind, Status, Trajectory

PREFIX = "turn_reward/"


def turn_rewards(t: Trajectory) -> dict[int, float]:
    return {int(k[len(PREFIX):]): float(v) for k, v in t.reward_parts.items() if k.startswith(PREFIX)}


def turn_returns(t: Trajectory, gamma: float) -> dict[int, float]:
    """Per model turn of ``t``, the discounted return from that turn on (outcome at the last turn)."""
    turns = sorted({s.turn for s in t.spans if s.kind is SpanKind.MODEL})
    given = turn_rewards(t)
    out, running = {}, 0.0
    for i, k in enumerate(reversed(turns)):
        r = given.get(k, 0.0) + (float(t.reward or 0.0) if i == 0 else 0.0)
        running = r + gamma * running
        out[k] = running
    return out


def turn_advantages(trajectories: Sequence[Trajectory], gamma: float, normalize_std: bool,
                    rloo: bool = False, eps: float = 1e-6) -> list[list[float]]:
    returns = [turn_returns(t, gamma) for t in trajectories]
    firsts = [r[min(r)] if r else float(t.reward or 0.0) for r, t in zip(returns, trajectories)]
    members: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        members.setdefault(t.group_id, []).append(i)
    rows = []
    for i, t in enumerate(trajectories):
        idx = members[t.group_id]
        row = [0.0] * t.response_length
        if len(idx) >= 2:
            vals = [firsts[j] for j in idx]
            mean = (sum(vals) - firsts[i]) / (len(vals) - 1) if rloo else sum(vals) / len(vals)
            full_mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - full_mean) ** 2 for v in vals) / len(vals)) if normalize_std else 1.0
            scale = 1.0 / (std + eps) if normalize_std else 1.0
            last = 0.0
            for s in t.spans:  # observation tokens carry the preceding turn's value (the mask decides)
                if s.kind is SpanKind.MODEL:
                    last = (returns[i][s.turn] - mean) * scale
                row[s.start:s.end] = [last] * (s.end - s.start)
        rows.append(row)
    return rows


def apply_overlong(trajectories: Sequence[Trajectory], advantages: list[list[float]], mode: str,
                   weight: float) -> dict[str, float]:
    """``algo.overlong``: a truncated trajectory's loss mask zeroed (``mask``) or its advantages scaled
    (``downweight``); in place. Returns how many were touched."""
    cut = [i for i, t in enumerate(trajectories) if t.status is Status.TRUNCATED]
    if mode == "mask":
        for i in cut:
            trajectories[i].loss_mask = [0] * len(trajectories[i].loss_mask)
    elif mode == "downweight":
        for i in cut:
            advantages[i] = [a * weight for a in advantages[i]]
    return {"overlong/truncated": float(len(cut))} if mode != "keep" else {}
