"""On-policy distillation signals: pure functions on the student's sampled tokens.

The student samples; a teacher scores the same tokens. Per sampled token ``t`` the reverse-KL sample
is ``kl_t = log pi_student(y_t) - log pi_teacher(y_t)`` (its mean over tokens the student sampled
estimates ``KL(student || teacher)``). Two ways to train on it, which take the same gradient when the
policy ratio is 1, ``coef * kl_t * grad log pi(y_t)`` -- the score-function gradient of the per-token
reverse KL:

* ``reward``: ``-coef * kl_t`` is folded into token ``t``'s advantage (beside ``task_coef`` times the
  task-reward advantage), and the usual policy loss does the rest (clipping included);
* ``loss``: a loss term ``coef * kl_t**2 / 2`` on the trainer's own logprobs (teacher fixed). Not
  ``coef * kl_t`` itself: its gradient, ``grad log pi(y_t)``, is zero in expectation on-policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles_agent.errors import UserError
from miles_agent.types import Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

MODES = ("reward", "loss")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise UserError(f"unknown distillation mode {mode!r}; choose one of: {', '.join(MODES)} "
                        "(config key algo.distill_mode)")
    return mode


def reverse_kl_tokens(trajectory: Trajectory, student: Sequence[float], teacher: Sequence[float]) -> list[float]:
    """``student - teacher`` at each trainable response token, 0.0 elsewhere (tool output, template)."""
    n = trajectory.response_length
    if len(student) != n or len(teacher) != n:
        raise ValueError(f"trajectory {trajectory.uid}: {len(student)} student / {len(teacher)} teacher "
                         f"logprobs for {n} response tokens")
    return [s - t if m else 0.0 for s, t, m in zip(student, teacher, trajectory.loss_mask)]


def fold_into_advantages(task_advantages: Sequence[Sequence[float]], kl: Sequence[Sequence[float]], *,
                         coef: float, task_coef: float) -> list[list[float]]:
    """Per-token ``task_coef * A_task - coef * kl_t`` (the ``reward`` mode)."""
    return [[task_coef * a - coef * k for a, k in zip(adv, row)] for adv, row in zip(task_advantages, kl)]


def masked_mean(values: Sequence[Sequence[float]], trajectories: Sequence[Trajectory]) -> float:
    """Mean of ``values`` over every trajectory's loss-masked (trainable) tokens."""
    total = count = 0.0
    for row, t in zip(values, trajectories):
        for v, m in zip(row, t.loss_mask):
            if m:
                total, count = total + v, count + 1
    return total / count if count else 0.0


def distill_loss(logp: Tensor, teacher_logp: Tensor, mask: Tensor, *, coef: float, loss_agg: str = "token_mean",
                 num_tokens: float | None = None, num_seqs: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The ``loss`` mode's term, ``coef * agg((logp - teacher_logp)**2 / 2)``, with metric shares
    ``distill_kl`` (token mean of ``logp - teacher_logp``, the reverse-KL estimate) and ``distill_loss``."""
    import torch

    from miles_agent.algorithms.losses import aggregate

    mask = mask.to(logp.dtype)
    kl = logp - teacher_logp
    term = coef * aggregate(0.5 * kl ** 2, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {"distill_kl": aggregate(kl, mask, "token_mean", num_tokens=num_tokens),
                   "distill_loss": term.detach()}
    return term, metrics
