"""One micro-batch's loss and metric shares, as every policy trainer computes them (FSDP2, Megatron).

A backend computes ``logp`` (and ``entropy``) its own way -- sharded, vocabulary-parallel, pipelined --
and hands them here with the micro-batch: the mismatch correction (``algorithms/mismatch.py``), the
policy loss with KL and entropy terms (``algorithms/losses.py``), the distillation term when the batch
carries teacher logprobs, and the mismatch metrics. So both backends train on the same objective.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from miles_agent.algorithms import mismatch
from miles_agent.algorithms.distill import distill_loss
from miles_agent.algorithms.losses import compute_loss
from miles_agent.config import AlgoConfig
from miles_agent.trainers.batching import MicroBatch
from miles_agent.trainers.minibatch import row_weight_tensor


def micro_batch_loss(algo: AlgoConfig, loss_opts: dict[str, Any], logp: Tensor, entropy: Tensor | None,
                     mb: MicroBatch, old: Tensor | None, ref: Tensor | None, norm: dict,
                     measure: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """``mb``'s share of the optimizer step's loss (normalized by the step's ``norm``), and its metric
    shares (sum them over micro-batches and ranks). ``old`` / ``ref``: the old and reference policies'
    logprobs on ``mb``'s grid (None: the rollout's / no reference); ``measure``: add the mismatch sums
    (where the trainer's pre-update logprobs are known)."""
    a = algo
    is_weights = None
    if a.mismatch_correction != "none":  # check_options guarantees the trainer's own old logprobs
        is_weights = mismatch.correction_weights(old, mb.rollout_logp, mb.loss_mask,
                                                 correction=a.mismatch_correction, level=a.mismatch_level,
                                                 low=a.mismatch_low, high=a.mismatch_high, veto=a.mismatch_veto)
    loss, metrics = compute_loss(logp, mb.rollout_logp if old is None else old, mb.advantages, mb.loss_mask,
                                 ref_logp=ref, entropy=entropy, is_weights=is_weights,
                                 num_tokens=norm["num_tokens"], num_seqs=norm["num_seqs"],
                                 row_weights=row_weight_tensor(mb, norm), **loss_opts)
    if mb.teacher_logp is not None:  # on-policy distillation in loss mode (algorithms/distill.py)
        term, extra = distill_loss(logp, mb.teacher_logp, mb.loss_mask, coef=a.distill_coef,
                                   loss_agg=a.loss_agg, num_tokens=norm["num_tokens"], num_seqs=norm["num_seqs"])
        loss, metrics = loss + term, {**metrics, **extra, "loss": metrics["loss"] + extra["distill_loss"]}
    if is_weights is not None:
        metrics["mismatch/masked_tokens"] = ((is_weights == 0) & (mb.loss_mask > 0)).float().sum()
        metrics["mismatch/weight_sum"] = (is_weights * mb.loss_mask).sum()
    if measure:
        pre_update = logp.detach() if old is None else old
        sums = mismatch.mismatch_sums(pre_update, mb.rollout_logp, mb.loss_mask, low=a.mismatch_low,
                                      high=a.mismatch_high)
        metrics.update({f"mismatch/{k}": v for k, v in sums.items()})
    return loss, metrics
