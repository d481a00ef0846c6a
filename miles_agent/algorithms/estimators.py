"""Every advantage estimator by name (``algo.advantage``), and what each one needs from the trainer.

* per-sample (``advantages.py``): ``grpo`` (``algo.normalize_std=false`` is Dr.GRPO), ``dr_grpo``,
  ``rloo`` -- one scalar per trajectory from its group, broadcast over its response tokens;
* per-token (``returns.py``): ``reinforce_pp``, ``reinforce_pp_baseline`` (REINFORCE++) and ``gae``
  (PPO with a critic) -- they may fold the KL to the reference into the reward
  (``algo.kl_reward_coef``), and ``gae`` needs the critic's values.

The module needs no torch: the driver hands it lists (rewards, loss masks, per-token KL and values).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles_agent import plugins
from miles_agent.algorithms import returns, turns
from miles_agent.algorithms.advantages import ADVANTAGES, check_rewards, get_advantage_fn, per_token
from miles_agent.errors import UserError
from miles_agent.types import Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from miles_agent.config import AlgoConfig

TOKEN_LEVEL = ("reinforce_pp", "reinforce_pp_baseline", "gae")
ESTIMATORS = (*ADVANTAGES, *TOKEN_LEVEL)

Rows = list[list[float]]


def needs_critic(algo: AlgoConfig) -> bool:
    return algo.advantage == "gae"


def needs_reference(algo: AlgoConfig) -> bool:
    """A frozen reference policy is needed for KL as a loss term or as a reward penalty."""
    return algo.kl_coef > 0 or algo.kl_reward_coef > 0


def check_estimator(algo: AlgoConfig, samples_per_prompt: int | None = None) -> None:
    """Fail before any work on a misspelled estimator or driver-side options it cannot honour."""
    if algo.advantage not in ESTIMATORS and not plugins.is_path(algo.advantage):  # a path: plugins.check_config
        raise UserError(f"unknown advantage estimator {algo.advantage!r}; choose one of: {', '.join(ESTIMATORS)} "
                        "(config key algo.advantage)")
    if algo.kl_reward_coef < 0 or algo.kl_coef < 0:
        raise UserError(f"algo.kl_coef / algo.kl_reward_coef must be >= 0 (got {algo.kl_coef}, "
                        f"{algo.kl_reward_coef})")
    if algo.kl_reward_coef > 0 and algo.advantage not in TOKEN_LEVEL:
        raise UserError(f"algo.kl_reward_coef folds a per-token KL into the reward, which the per-sample "
                        f"estimator {algo.advantage!r} cannot use; use algo.kl_coef (KL as a loss) or one of "
                        f"{', '.join(TOKEN_LEVEL)}")
    if not 0.0 <= algo.gamma <= 1.0 or not 0.0 <= algo.gae_lambda <= 1.0:
        raise UserError(f"algo.gamma and algo.gae_lambda must lie in [0, 1] (got {algo.gamma}, {algo.gae_lambda})")
    if algo.loss_agg == "group_mean_token_mean" and algo.distill_teacher and algo.distill_mode == "loss":
        raise UserError("algo.loss_agg=group_mean_token_mean is not supported with algo.distill_mode=loss yet; "
                        "use another loss_agg or distill_mode=reward")
    if not 0.0 <= algo.turn_discount <= 1.0:
        raise UserError(f"algo.turn_discount must lie in [0, 1] (got {algo.turn_discount})")
    if algo.overlong not in ("keep", "mask", "downweight"):
        raise UserError(f"algo.overlong={algo.overlong!r}: choose one of keep, mask, downweight")
    if algo.dynamic_sampling and algo.dynamic_sampling_max_rounds < 1:
        raise UserError(f"algo.dynamic_sampling_max_rounds must be >= 1 (got {algo.dynamic_sampling_max_rounds})")
    if algo.dynamic_sampling and samples_per_prompt is not None and samples_per_prompt < 2:
        raise UserError(f"algo.dynamic_sampling keeps groups whose rewards differ, which needs "
                        f"rollout.samples_per_prompt >= 2 (got {samples_per_prompt})")


def estimate(algo: AlgoConfig, trajectories: Sequence[Trajectory], *, kl: Sequence[Sequence[float]] | None = None,
             values: Sequence[Sequence[float]] | None = None) -> tuple[Rows, Rows | None]:
    """Per-token advantages for ``trajectories`` (and the critic's return targets for ``gae``).

    ``kl``: per response token, the chosen estimate of KL(old policy || reference) -- used only when
    ``algo.kl_reward_coef > 0``. ``values``: the critic's value per response token (``gae`` only).
    """
    check_estimator(algo)
    rewards = [float(t.reward) if t.reward is not None else float("nan") for t in trajectories]
    groups, episodes = [t.group_id for t in trajectories], [t.episode_id for t in trajectories]
    if plugins.is_path(algo.advantage):
        return user_advantages(algo, trajectories, rewards, groups), None
    if algo.advantage in ADVANTAGES:
        if algo.turn_discount < 1.0 or any(turns.turn_rewards(t) for t in trajectories):
            return turns.turn_advantages(trajectories, algo.turn_discount, algo.normalize_std and
                                         algo.advantage == "grpo", rloo=algo.advantage == "rloo"), None
        adv = get_advantage_fn(algo.advantage)(rewards, groups, normalize_std=algo.normalize_std,
                                               episode_ids=episodes)
        return per_token(trajectories, adv), None
    check_rewards(rewards, groups)
    masks = [t.loss_mask for t in trajectories]
    kl_opts = {"kl": kl, "kl_coef": algo.kl_reward_coef} if algo.kl_reward_coef > 0 else {}
    if algo.kl_reward_coef > 0 and kl is None:
        raise ValueError("algo.kl_reward_coef > 0 needs the per-token KL to the reference")
    if algo.advantage == "gae":
        if values is None:
            raise ValueError("the gae estimator needs the critic's values")
        return returns.gae(rewards, masks, values, gamma=algo.gamma, lam=algo.gae_lambda, **kl_opts)
    return returns.reinforce_pp(rewards, masks, group_ids=groups, episode_ids=episodes,
                                baseline=algo.advantage == "reinforce_pp_baseline", gamma=algo.gamma, **kl_opts)


def user_advantages(algo: AlgoConfig, trajectories: Sequence[Trajectory], rewards: list[float],
                    groups: list[str]) -> Rows:
    """``algo.advantage=module:fn``: one value per trajectory (broadcast) or one row of per-token values."""
    check_rewards(rewards, groups)
    out = plugins.load("algo.advantage", algo.advantage)(rewards, groups, trajectories=list(trajectories), algo=algo)
    if all(isinstance(a, (int, float)) for a in out) and len(out) == len(trajectories):
        return per_token(trajectories, out)
    if len(out) != len(trajectories) or any(len(r) != t.response_length for r, t in zip(out, trajectories)):
        raise ValueError(f"algo.advantage={algo.advantage} returned {len(out)} values for {len(trajectories)} "
                         "trajectories; return one number or one row of response_length numbers per trajectory")
    return [[float(a) for a in row] for row in out]
