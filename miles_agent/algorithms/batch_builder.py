"""What the driver does between rollout and the policy step: the advantages and what they need.

The trainer stays algorithm-blind: this module asks it only for logprobs (the old and reference
policies', when the estimator folds KL into the reward), asks the critic for values (GAE), runs the
estimator chosen by ``algo.advantage``, steps the critic on the resulting returns, and hands the
trainer a ``TrainBatch`` of per-token advantages (plus the logprobs it already computed, so the
trainer does not compute them again).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_agent import plugins
from miles_agent.algorithms.estimators import check_estimator, estimate, needs_critic
from miles_agent.algorithms.losses import get_kl_estimator
from miles_agent.algorithms.turns import apply_overlong
from miles_agent.config import AlgoConfig
from miles_agent.trainer import TrainBatch
from miles_agent.types import Trajectory


def token_kl(old: Sequence[Sequence[float]], ref: Sequence[Sequence[float]], estimator: str) -> list[list[float]]:
    """Per response token, ``estimator``'s estimate of KL(old policy || reference)."""
    import torch

    fn = get_kl_estimator(estimator)
    return [fn(torch.tensor(o, dtype=torch.float64), torch.tensor(r, dtype=torch.float64)).tolist()
            for o, r in zip(old, ref)]


class BatchBuilder:
    def __init__(self, algo: AlgoConfig, trainer: Any, critic: Any = None) -> None:
        check_estimator(algo)
        if needs_critic(algo) and critic is None:
            raise ValueError(f"algo.advantage={algo.advantage} needs a critic (components.build_critic)")
        self.algo, self.trainer, self.critic = algo, trainer, critic

    def build(self, trajectories: list[Trajectory]) -> tuple[TrainBatch, dict[str, float]]:
        """The policy's train batch, and metrics (the critic's, when there is one, and advantage stats)."""
        algo = self.algo
        masked = apply_mask_filter(algo.loss_mask_filter, trajectories)
        old = ref = kl = values = None
        if algo.kl_reward_coef > 0:
            ref = self.trainer.compute_logprobs(trajectories, reference=True)
            old = ([list(t.rollout_logprobs) for t in trajectories] if algo.use_rollout_logprobs
                   else self.trainer.compute_logprobs(trajectories))
            kl = token_kl(old, ref, algo.kl_estimator)
        if self.critic is not None:
            values = self.critic.values(trajectories)
        advantages, returns = estimate(algo, trajectories, kl=kl, values=values)
        metrics = {**masked, **apply_overlong(trajectories, advantages, algo.overlong, algo.overlong_weight)}
        metrics.update(advantage_stats(trajectories, advantages))
        if self.critic is not None:
            metrics.update({f"critic/{k}": v for k, v in
                            self.critic.train_step(trajectories, returns, values).items()})
        batch = TrainBatch(trajectories, advantages, old_logprobs=None if algo.use_rollout_logprobs else old,
                           ref_logprobs=ref)
        return batch, metrics

    def save_checkpoint(self, path: Path) -> None:
        if self.critic is not None:
            self.critic.save_checkpoint(Path(path) / "critic")

    def load_checkpoint(self, path: Path) -> None:
        if self.critic is not None:
            self.critic.load_checkpoint(Path(path) / "critic")

    def close(self) -> None:
        if self.critic is not None:
            self.critic.close()


def advantage_stats(trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean and mean absolute advantage over trainable tokens: a collapsed batch shows as |A| ~ 0."""
    vals = [a for t, row in zip(trajectories, advantages) for a, m in zip(row, t.loss_mask) if m]
    if not vals:
        return {"adv/mean": 0.0, "adv/abs_mean": 0.0}
    return {"adv/mean": sum(vals) / len(vals), "adv/abs_mean": sum(abs(v) for v in vals) / len(vals)}


def apply_mask_filter(path: str, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``algo.loss_mask_filter``: per trajectory, False zeroes its loss mask, a 0/1 list is ANDed into it."""
    touched = 0
    for t in trajectories if path else ():
        got = plugins.load("algo.loss_mask_filter", path)(t)
        keep = [int(got)] * len(t.loss_mask) if isinstance(got, bool) else [int(bool(k)) for k in got]
        if len(keep) != len(t.loss_mask):
            raise ValueError(f"algo.loss_mask_filter={path} returned {len(keep)} values for a response of "
                             f"{len(t.loss_mask)} tokens; return a bool or one 0/1 per response token")
        new = [m & k for m, k in zip(t.loss_mask, keep)]
        touched, t.loss_mask = touched + int(new != t.loss_mask), new
    return {"loss_mask_filter/changed": float(touched)} if path else {}
