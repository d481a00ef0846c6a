"""Policy losses, KL estimators and loss aggregation: pure torch functions on ``[B, T]`` tensors.

All inputs share one grid: ``logp`` (current policy logprob of each token), ``old_logp`` (the
behaviour policy's), ``advantages``, ``mask`` (1.0 where a token trains), optionally ``ref_logp``
and ``entropy``. Policy losses and KL estimators are chosen by name from registries, so a recipe
(and a plug-in) can add one without touching the trainer.

Global-batch normalization: a trainer that splits a batch into micro-batches (and ranks) passes
the *global* denominators ``num_tokens`` / ``num_seqs``. Each micro-batch's loss is then its share
of the whole batch's loss, so summing micro-batch losses (accumulating their gradients) gives
exactly the full-batch loss and gradient. The metrics are shares the same way: sum them over
micro-batches (and ranks) to get the batch value.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from miles_agent import plugins
from miles_agent.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from miles_agent.config import AlgoConfig

# (logp, old_logp, advantages, **options) -> (per-token loss, per-token 0/1 "clipped" or None)
PolicyLossFn = Callable[..., tuple[Tensor, Tensor | None]]
KLFn = Callable[[Tensor, Tensor], Tensor]

AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "group_mean_token_mean")


# -- policy losses ---------------------------------------------------------------------------------

def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_eps: float, clip_eps_high: float | None,
                       dual_clip_c: float | None) -> tuple[Tensor, Tensor]:
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip_c is not None:  # negative advantages: the loss is capped at -c * A
        cap = -dual_clip_c * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.to(ratio.dtype)


def ppo_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, clip_eps: float = 0.2,
             clip_eps_high: float | None = None, dual_clip_c: float | None = None,
             **_: object) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``.

    ``clip_eps_high`` > ``clip_eps`` is DAPO's clip-higher: low-probability tokens with positive
    advantage may grow further before the clip stops them, which keeps entropy from collapsing.
    ``dual_clip_c`` (> 1) is dual clip (Ye et al. 2020): for ``A < 0`` the loss is at most ``-c * A``,
    so a token whose ratio exploded cannot dominate the batch. The second tensor marks tokens where
    a clip won (their gradient is zero). The log ratio is clamped to +-20 so one token the old
    policy found impossible (a stale or mismatched rollout logprob) cannot turn the loss into inf/NaN.
    """
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    return _clipped_surrogate(ratio, advantages, clip_eps, clip_eps_high, dual_clip_c)


def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, mask: Tensor, clip_eps: float = 3e-4,
         clip_eps_high: float | None = None, dual_clip_c: float | None = None,
         **_: object) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios
    ``s = exp(mean_t(logp - old_logp))`` over trainable tokens, clipped at sequence level.

    Written in the paper's GSPO-token form: every token carries ``s * pi/sg(pi)``, whose value is
    ``s`` and whose gradient is ``s * grad logp_t``, so with ``loss_agg=seq_mean_token_mean`` the
    loss and its gradient are exactly the sequence-level objective. The paper's clip ranges are
    small (3e-4 / 4e-4) because ``s`` is a per-token average.
    """
    mask = mask.to(logp.dtype)
    log_r = (logp - old_logp).clamp(-20.0, 20.0) * mask
    seq_log_ratio = log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(seq_log_ratio.detach() + logp - logp.detach())
    return _clipped_surrogate(ratio, advantages, clip_eps, clip_eps_high, dual_clip_c)


def sft(logp: Tensor, old_logp: Tensor, advantages: Tensor, **_: object) -> tuple[Tensor, None]:
    """Negative log-likelihood of the masked tokens; advantages and the old policy are ignored."""
    return -logp, None


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip, "gspo": gspo, "sft": sft}


# -- KL estimators (Schulman, "Approximating KL divergence"); logr = ref_logp - logp ------------------

def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``-logr``: unbiased for KL(pi || ref) but high-variance and often negative per token."""
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``logr**2 / 2``: biased, low-variance, always >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``exp(logr) - logr - 1``: unbiased and always >= 0. ``logr`` is clamped to +-20 so a token
    the reference finds impossible cannot overflow the loss."""
    logr = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(logr) - logr - 1.0


KL_ESTIMATORS: dict[str, KLFn] = {"k1": k1, "k2": k2, "k3": k3}


def _lookup(registry: dict[str, Any], name: str, what: str, key: str) -> Any:
    try:
        return registry[name]
    except KeyError:
        raise UserError(f"unknown {what} {name!r}; choose one of: {', '.join(registry)} "
                        f"(config key {key})") from None


def get_policy_loss(name: str) -> PolicyLossFn:
    if plugins.is_path(name):  # algo.loss=module:fn, its signature checked once (plugins.KINDS)
        return plugins.load("algo.loss", name)
    return _lookup(POLICY_LOSSES, name, "policy loss", "algo.loss")


def get_kl_estimator(name: str) -> KLFn:
    return _lookup(KL_ESTIMATORS, name, "KL estimator", "algo.kl_estimator")


def check_agg_mode(mode: str) -> str:
    if mode not in AGG_MODES and not plugins.is_path(mode):  # module:fn, a user's: plugins.check_config
        raise UserError(f"unknown loss aggregation {mode!r}; choose one of: {', '.join(AGG_MODES)} "
                        "(config key algo.loss_agg)")
    return mode


# -- aggregation -----------------------------------------------------------------------------------

def count_seqs(mask: Tensor) -> int:
    """Sequences with at least one trainable token: a fully masked one (e.g. aborted) does not dilute."""
    return int((mask.sum(-1) > 0).sum().item())


def group_row_weights(group_ids: Sequence[Hashable], token_counts: Sequence[float]) -> list[float]:
    """Per sequence, ``1 / (groups * trainable tokens in its group)``: the row weights with which a
    sum of token sums is ``group_mean_token_mean`` (every group weighs the same, and every token
    the same within its group). Groups without trainable tokens do not count."""
    totals: dict[Hashable, float] = {}
    for g, n in zip(group_ids, token_counts):
        totals[g] = totals.get(g, 0.0) + float(n)
    live = sum(1 for n in totals.values() if n > 0)
    return [1.0 / (live * totals[g]) if totals[g] > 0 else 0.0 for g in group_ids]


def aggregate(values: Tensor, mask: Tensor, mode: str = "token_mean", *, num_tokens: float | None = None,
              num_seqs: float | None = None, row_weights: Tensor | None = None) -> Tensor:
    """Reduce per-token ``values`` over the masked tokens to a scalar.

    * ``token_mean``: sum over all masked tokens / ``num_tokens`` (every token weighs the same).
    * ``seq_mean_token_sum``: per-sequence sums, averaged over ``num_seqs`` (Dr.GRPO's constant
      normalizer when all sequences share a max length).
    * ``seq_mean_token_mean``: per-sequence means, averaged over ``num_seqs`` (the original GRPO).
    * ``group_mean_token_mean``: per-group token means, averaged over groups; needs ``row_weights``
      from :func:`group_row_weights` (without them the whole tensor is one group).

    ``num_tokens`` / ``num_seqs`` default to this tensor's own counts; pass the global batch's
    counts when ``values`` is one micro-batch of many. No sequence may be split across calls.
    """
    if plugins.is_path(mode):
        return plugins.load("algo.loss_agg", mode)(values, mask, num_tokens=num_tokens, num_seqs=num_seqs,
                                                   row_weights=row_weights)
    masked = values * mask
    if mode == "token_mean":
        denom = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
        return masked.sum() / max(denom, 1.0)
    denom = float(count_seqs(mask)) if num_seqs is None else float(num_seqs)
    if mode == "seq_mean_token_sum":
        return masked.sum(-1).sum() / max(denom, 1.0)
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(denom, 1.0)
    if mode == "group_mean_token_mean":
        if row_weights is None:
            return masked.sum() / max(float(mask.sum().item()), 1.0)
        return (masked.sum(-1) * row_weights.to(masked.dtype)).sum()
    check_agg_mode(mode)
    raise AssertionError("unreachable")


# -- the combined loss -----------------------------------------------------------------------------

def compute_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 loss: str = "ppo_clip", clip_eps: float = 0.2, clip_eps_high: float | None = None,
                 dual_clip_c: float | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                 entropy_coef: float = 0.0, loss_agg: str = "token_mean", ref_logp: Tensor | None = None,
                 entropy: Tensor | None = None, is_weights: Tensor | None = None,
                 num_tokens: float | None = None, num_seqs: float | None = None,
                 row_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss + ``kl_coef`` * KL to the reference - ``entropy_coef`` * entropy.

    ``is_weights`` (detached, per token) multiply the policy loss: the rollout/training mismatch
    correction of ``mismatch.py`` (0 masks a token out, but it still counts in the normalizers).

    Returns the scalar loss and detached metric shares: ``loss``, ``pg_loss``, ``clipfrac`` (when the
    policy loss clips), ``approx_kl`` (k3 estimate of KL to the old policy), ``kl`` (to the reference,
    when ``ref_logp`` is given) and ``entropy`` (when given). The three KL/clip metrics are token
    means (as logged by most frameworks); ``pg_loss``, ``kl`` and ``entropy`` use ``loss_agg``.
    """
    mask = mask.to(logp.dtype)
    agg = dict(mode=check_agg_mode(loss_agg), num_tokens=num_tokens, num_seqs=num_seqs, row_weights=row_weights)
    tok = dict(mode="token_mean", num_tokens=num_tokens)
    pg_tok, clipped = get_policy_loss(loss)(logp, old_logp, advantages, mask=mask, clip_eps=clip_eps,
                                            clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)
    if is_weights is not None:
        pg_tok = pg_tok * is_weights.detach()
    pg = aggregate(pg_tok, mask, **agg)
    total = pg
    metrics: dict[str, Tensor] = {"pg_loss": pg.detach()}
    if clipped is not None:
        metrics["clipfrac"] = aggregate(clipped, mask, **tok).detach()
    with torch.no_grad():
        metrics["approx_kl"] = aggregate(k3(logp, old_logp), mask, **tok)
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (the reference model's logprobs)")
    if ref_logp is not None:
        kl = aggregate(get_kl_estimator(kl_estimator)(logp, ref_logp), mask, **agg)
        metrics["kl"] = kl.detach()
        if kl_coef > 0:
            total = total + kl_coef * kl
    if entropy is not None:
        ent = aggregate(entropy, mask, **agg)
        metrics["entropy"] = ent.detach()
        if entropy_coef != 0:
            total = total - entropy_coef * ent
    metrics["loss"] = total.detach()
    return total, metrics


def loss_options(algo: AlgoConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`compute_loss` taken from an ``AlgoConfig``."""
    keys = ("loss", "clip_eps", "clip_eps_high", "dual_clip_c", "kl_coef", "kl_estimator", "entropy_coef",
            "loss_agg")
    return {k: getattr(algo, k) for k in keys}


def validate_options(algo: AlgoConfig) -> None:
    """Fail at construction, not at the first step, on a misspelled loss, estimator or mode."""
    get_policy_loss(algo.loss)
    get_kl_estimator(algo.kl_estimator)
    check_agg_mode(algo.loss_agg)
    if algo.clip_eps < 0 or (algo.clip_eps_high is not None and algo.clip_eps_high < 0):
        raise UserError(f"algo.clip_eps / algo.clip_eps_high must be >= 0 (got {algo.clip_eps}, "
                        f"{algo.clip_eps_high})")
    if algo.dual_clip_c is not None and not algo.dual_clip_c > 1.0:
        raise UserError(f"algo.dual_clip_c must be > 1 (got {algo.dual_clip_c}); typical is 3, or null to disable")

