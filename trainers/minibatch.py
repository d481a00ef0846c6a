"""Mini-batches: several optimizer steps per rollout batch, and the per-batch loss normalizers.

With ``train.mini_batches = n`` the rollout batch is cut into ``n`` shares, one optimizer step each
(``train.ppo_epochs`` passes over them). Only the first step sees the weights that sampled the data,
so from the second on the PPO ratio moves away from 1 and the clip (and the mismatch corrections)
start to bind. Shares keep a group's sequences together where the sizes allow, so group-level loss
aggregation sees whole groups. Each share is normalized by its own token / sequence / group counts:
every optimizer step is the mean over its own data. ``PolicyTrainer.plan_steps`` (policy_trainer.py)
lays a batch out with these functions; the critic uses them directly.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from miles_agent.algorithms.losses import group_row_weights
from miles_agent.trainers.batching import MicroBatch
from miles_agent.types import Trajectory


def split_mini_batches(group_ids: Sequence[Hashable], n: int) -> list[list[int]]:
    """``n`` (at most one per sequence) contiguous shares of the batch indices, ordered by group
    (first-seen order), as equal in sequence count as possible; deterministic."""
    order_of: dict[Hashable, int] = {}
    for g in group_ids:
        order_of.setdefault(g, len(order_of))
    order = sorted(range(len(group_ids)), key=lambda i: (order_of[group_ids[i]], i))
    n = max(1, min(n, len(order)))
    base, extra = divmod(len(order), n)
    out, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(order[start:start + size])
        start += size
    return out


def normalizers(trajectories: Sequence[Trajectory], indices: Sequence[int], loss_agg: str) -> dict:
    """The global denominators of one optimizer step over ``trajectories[indices]`` (see losses.aggregate)."""
    rows = [trajectories[i] for i in indices]
    norm: dict = {"num_tokens": float(sum(sum(t.loss_mask) for t in rows)),
                  "num_seqs": float(sum(1 for t in rows if any(t.loss_mask)))}
    if loss_agg == "group_mean_token_mean":
        weights = group_row_weights([t.group_id for t in rows], [sum(t.loss_mask) for t in rows])
        norm["row_weights"] = dict(zip(indices, weights))
    return norm


def row_weight_tensor(mb: MicroBatch, norm: dict) -> Tensor | None:
    """This micro-batch's row weights (a filler row weighs 0), or None when the mode needs none."""
    if "row_weights" not in norm:
        return None
    vals = [norm["row_weights"][i] for i in mb.indices] or [0.0]
    return torch.tensor(vals, dtype=torch.float32, device=mb.loss_mask.device)


def to_grid(mb: MicroBatch, rows: Sequence[Sequence[float]]) -> Tensor:
    """Lay per-response-token values (indexed by batch index) on ``mb``'s grid; 0.0 elsewhere."""
    grid = torch.zeros(mb.loss_mask.shape, dtype=torch.float32)
    for b, (i, (c, n)) in enumerate(zip(mb.indices, mb.response_cols)):
        grid[b, c:c + n] = torch.tensor(rows[i][:n], dtype=torch.float32)
    return grid.to(mb.loss_mask.device)


def step_metrics(values: dict[str, float], abs_max: float, grad_norms: Sequence[float],
                 trajectories: Sequence[Trajectory], n_minis: int, ppo_epochs: int, lr: float,
                 step: int) -> dict[str, float]:
    """A ``train_step``'s metrics from its metric shares summed over micro-batches and ranks: loss terms
    as means over optimizer steps, mismatch metrics per measured (or trained) token."""
    out = {k: v / len(grad_norms) for k, v in values.items() if not k.startswith("mismatch/")}
    measured = max(values.get("mismatch/tokens", 0.0), 1.0)
    if "mismatch/tokens" in values:
        out.update(logprob_mismatch_mean=values["mismatch/abs_sum"] / measured, logprob_mismatch_max=abs_max,
                   mismatch_k1=values["mismatch/k1_sum"] / measured,
                   mismatch_k3=values["mismatch/k3_sum"] / measured,
                   mismatch_out_of_range=values["mismatch/out_of_range"] / measured)
    tokens = float(sum(sum(t.loss_mask) for t in trajectories))
    trained = max(tokens * ppo_epochs, 1.0)
    if "mismatch/weight_sum" in values:  # over every token of every step
        out.update(mismatch_masked_frac=values["mismatch/masked_tokens"] / trained,
                   mismatch_weight_mean=values["mismatch/weight_sum"] / trained)
    finite = [g for g in grad_norms if math.isfinite(g)]
    out.update(grad_norm=sum(finite) / len(finite) if finite else math.nan, lr=lr, tokens=tokens,
               seqs=float(sum(1 for t in trajectories if any(t.loss_mask))), step=float(step),
               optimizer_steps=float(len(grad_norms)), mini_batches=float(n_minis),
               skipped_step=float(len(grad_norms) - len(finite)))
    return out

