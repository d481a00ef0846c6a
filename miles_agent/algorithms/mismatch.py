"""Rollout/training mismatch: how far the trainer's logprobs are from the engine's, and corrections.

The rollout engine and the trainer compute the same policy with different kernels (and, in async
RL, possibly different weights), so ``pi_train(y) != pi_rollout(y)`` for the sampled tokens. With
``w = pi_train / pi_rollout`` per token (``pi_train`` = the trainer's old-policy logprob before any
update of this batch):

* metrics (:func:`mismatch_sums`): mean and max ``|log w|``, KL(rollout || train) estimated by k1
  (``-log w``) and k3 (``w - 1 - log w``) on tokens sampled from the rollout policy, and the share of
  tokens with ``w`` outside the trust range ``[low, high]``;
* corrections (:func:`correction_weights`), per-token weights that multiply the policy loss:
  - ``tis``: truncated importance sampling, ``min(w_level, high)`` (Yao et al. 2025);
  - ``mis``: masked importance sampling / rejection, ``w_level`` inside ``[low, high]``, 0 outside
    (the whole sequence at ``sequence`` / ``geometric`` level);
  - ``icepop``: token-level ``w`` inside ``[low, high]``, 0 outside (IcePop, Ring-1T report);
  where ``w_level`` is the token's own ``w`` (``token``), the sequence product ``prod_t w_t``
  (``sequence``) or its geometric mean ``exp(mean_t log w_t)`` (``geometric``). ``veto > 0`` also
  zeroes every sequence holding a token with ``w < veto`` (a token the trainer finds near-impossible).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles_agent.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from miles_agent.config import AlgoConfig

CORRECTIONS = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence", "geometric")


def check_options(algo: AlgoConfig) -> None:
    """A misspelled correction, a bad range, or a correction without the trainer's own old logprobs
    fails at construction, with the fix."""
    if algo.mismatch_correction not in CORRECTIONS:
        raise UserError(f"unknown mismatch correction {algo.mismatch_correction!r}; choose one of: "
                        f"{', '.join(CORRECTIONS)} (config key algo.mismatch_correction)")
    if algo.mismatch_level not in LEVELS:
        raise UserError(f"unknown mismatch level {algo.mismatch_level!r}; choose one of: {', '.join(LEVELS)} "
                        "(config key algo.mismatch_level)")
    if not 0 < algo.mismatch_low <= 1.0 <= algo.mismatch_high:
        raise UserError(f"algo.mismatch_low / algo.mismatch_high must satisfy 0 < low <= 1 <= high "
                        f"(got {algo.mismatch_low}, {algo.mismatch_high})")
    if algo.mismatch_veto < 0 or algo.mismatch_veto >= 1:
        raise UserError(f"algo.mismatch_veto must lie in [0, 1) (got {algo.mismatch_veto}); 0 disables it")
    if algo.mismatch_correction != "none" and algo.use_rollout_logprobs:
        raise UserError(f"algo.mismatch_correction={algo.mismatch_correction} weighs the trainer's old logprobs "
                        "against the rollout's, so the trainer must compute them: set "
                        "algo.use_rollout_logprobs=false")


def _level_log_ratio(log_w: Tensor, mask: Tensor, level: str) -> Tensor:
    """Per token, the log of the ratio the correction looks at (broadcast over the row if per sequence)."""
    if level == "token":
        return log_w
    total = (log_w * mask).sum(-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(log_w)
    return (total / mask.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(log_w)


@torch.no_grad()
def correction_weights(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, correction: str = "tis",
                       level: str = "token", low: float = 0.5, high: float = 2.0, veto: float = 0.0) -> Tensor:
    """Per-token loss weights (see the module docstring); 1.0 everywhere for ``none`` without veto."""
    mask = mask.to(train_logp.dtype)
    log_w = (train_logp - rollout_logp).clamp(-20.0, 20.0) * mask
    if correction == "icepop":
        level = "token"
    lw = _level_log_ratio(log_w, mask, level).clamp(max=20.0)
    w = torch.exp(lw)
    if correction == "none":
        weights = torch.ones_like(w)
    elif correction == "tis":
        weights = w.clamp(max=high)
    elif correction in ("mis", "icepop"):
        inside = (w >= low) & (w <= high)
        weights = torch.where(inside, w, torch.zeros_like(w))
    else:
        raise UserError(f"unknown mismatch correction {correction!r}; choose one of: {', '.join(CORRECTIONS)}")
    if veto > 0:
        vetoed = ((torch.exp(log_w) < veto) & (mask > 0)).any(-1, keepdim=True)
        weights = torch.where(vetoed, torch.zeros_like(weights), weights)
    return weights * mask


@torch.no_grad()
def mismatch_sums(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, low: float = 0.5,
                  high: float = 2.0) -> dict[str, Tensor]:
    """Sums over the masked tokens (add them over micro-batches and ranks, then divide by ``tokens``):
    ``abs_sum`` / ``abs_max`` of ``|log w|``, ``k1_sum`` / ``k3_sum`` (KL(rollout || train)),
    ``out_of_range`` (tokens with ``w`` outside ``[low, high]``) and ``tokens``."""
    mask = mask.to(train_logp.dtype)
    log_w = (train_logp - rollout_logp).clamp(-20.0, 20.0)
    w = torch.exp(log_w)
    absd = log_w.abs() * mask
    return {
        "abs_sum": absd.sum(),
        "abs_max": absd.max() if absd.numel() else torch.zeros((), device=absd.device),
        "k1_sum": (-log_w * mask).sum(),
        "k3_sum": ((w - 1.0 - log_w) * mask).sum(),
        "out_of_range": (((w < low) | (w > high)).to(mask.dtype) * mask).sum(),
        "tokens": mask.sum(),
    }
