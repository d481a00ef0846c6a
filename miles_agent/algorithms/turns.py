"""Turn-level credit for multi-turn agents, and overlong filtering (docs/algorithms.md).

Turn rewards come in ``Reward.parts`` as ``turn_reward/<k>``; the outcome ``reward`` counts at the last
turn. A token of turn k gets ``G_k = sum_{j>=k} gamma^(j-k) r_j`` (gamma = ``algo.turn_discount``) minus
its group's mean (rloo: leave-one-out) of episode returns, over their std for grpo: with no turn rewards
and gamma = 1, the per-sample estimator exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles_agent.types import SpanKind, Status, Trajectory


def turn_rewards(t: Trajectory) -> dict[int, float]:
    return {int(k[12:]): float(v) for k, v in t.reward_parts.items() if k.startswith("turn_reward/")}


def turn_returns(t: Trajectory, gamma: float) -> dict[int, float]:
    """Per model turn of ``t``, the discounted return from that turn on (the outcome at the last turn)."""
    given, out, running = turn_rewards(t), {}, float(t.reward or 0.0)
    for k in sorted({s.turn for s in t.spans if s.kind is SpanKind.MODEL}, reverse=True):
        running = given.get(k, 0.0) + running
        out[k], running = running, gamma * running
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
        vals, row, last = [firsts[j] for j in members[t.group_id]], [0.0] * t.response_length, 0.0
        if len(vals) >= 2:  # a lone sample has no baseline: advantage 0
            mean = sum(vals) / len(vals)
            base = (sum(vals) - firsts[i]) / (len(vals) - 1) if rloo else mean
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) + eps if normalize_std else 1.0
            for s in t.spans:  # observation tokens carry the preceding turn's value (the mask decides)
                last = (returns[i][s.turn] - base) / std if s.kind is SpanKind.MODEL else last
                row[s.start:s.end] = [last] * (s.end - s.start)
        rows.append(row)
    return rows


def apply_overlong(trajectories: Sequence[Trajectory], advantages: list[list[float]], mode: str,
                   weight: float) -> dict[str, float]:
    """``algo.overlong``: truncated trajectories' loss masks zeroed (mask) or advantages scaled (downweight)."""
    cut = [i for i, t in enumerate(trajectories) if t.status is Status.TRUNCATED]
    for i in cut if mode != "keep" else ():
        if mode == "mask":
            trajectories[i].loss_mask = [0] * len(trajectories[i].loss_mask)
        else:
            advantages[i] = [a * weight for a in advantages[i]]
    return {"overlong/truncated": float(len(cut))} if mode != "keep" else {}
