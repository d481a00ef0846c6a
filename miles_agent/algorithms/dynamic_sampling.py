"""DAPO dynamic sampling (Yu et al. 2025): train only on groups whose rewards differ.

A group whose episodes all got the same reward has zero advantage under any group baseline, so it
only dilutes the batch. :func:`dynamic_sample` drops such groups and rolls out more tasks until
``num_groups`` informative groups are collected (the extra groups of the last round are left out),
or ``max_rounds`` rounds have run -- then the step trains on what it has. If no group at all was
informative, the last round is returned unfiltered (its advantages are 0: the step changes nothing
through the policy loss, and it is logged as such), so a run never stalls on a too-easy task set.

Variance is judged per episode (``episode_id``; branches of one episode count once) over the
trainable members of the group; failed episodes stay with their group (the loop reports them) but do
not count. A group with fewer than two scored episodes has no baseline and is dropped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from miles_agent.types import Status, Trajectory

# (number of tasks, round index) -> every trajectory of that many groups
Rollout = Callable[[int, int], Awaitable[list[Trajectory]]]


def split_groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories per ``group_id``, groups in first-seen order."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


def is_informative(group: Sequence[Trajectory]) -> bool:
    """At least two scored episodes with different rewards (the mean over an episode's branches)."""
    per_episode: dict[str, list[float]] = {}
    for t in group:
        if t.status in (Status.COMPLETED, Status.TRUNCATED) and t.reward is not None:
            per_episode.setdefault(t.episode_id, []).append(float(t.reward))
    rewards = {round(sum(r) / len(r), 12) for r in per_episode.values()}
    return len(per_episode) >= 2 and len(rewards) >= 2


async def dynamic_sample(rollout: Rollout, num_groups: int, max_rounds: int) -> tuple[list[Trajectory], dict[str, float]]:
    """Roll out until ``num_groups`` informative groups are kept (or ``max_rounds`` rounds ran).

    Each round asks for as many new tasks as groups are still missing. Returns the kept groups'
    trajectories (at most ``num_groups`` groups, in the order they were kept) and metrics.
    """
    if num_groups < 1 or max_rounds < 1:
        raise ValueError(f"num_groups and max_rounds must be >= 1 (got {num_groups}, {max_rounds})")
    kept: list[list[Trajectory]] = []
    sampled = dropped = rounds = 0
    rewards: list[float] = []
    last: list[Trajectory] = []
    while len(kept) < num_groups and rounds < max_rounds:
        last = await rollout(num_groups - len(kept), rounds)
        rounds += 1
        rewards += [float(t.reward) for t in last if t.reward is not None]
        for group in split_groups(last):
            sampled += 1
            if is_informative(group):
                kept.append(group)
            else:
                dropped += 1
    fallback = not kept
    out = last if fallback else [t for g in kept[:num_groups] for t in g]
    metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/sampled_groups": float(sampled),
               "dynamic_sampling/dropped_groups": float(dropped),
               "dynamic_sampling/kept_groups": float(min(len(kept), num_groups)),
               "dynamic_sampling/unfilled": float(max(num_groups - len(kept), 0)),
               "dynamic_sampling/fallback": float(fallback),
               "dynamic_sampling/reward_mean_all": sum(rewards) / len(rewards) if rewards else 0.0}
    return out, metrics


class InformativeGroupFilter:
    """Dynamic sampling inside the streaming scheduler (``Scheduler.keep_group``): reject groups that
    are not informative, so the scheduler rolls out a new task in their place. After
    ``(max_rounds - 1) * groups_per_step`` rejections in a row the next group is kept whatever its
    rewards (``forced``), the streaming analogue of :func:`dynamic_sample`'s round limit: a too-easy
    task set slows a run down but never stalls it."""

    def __init__(self, groups_per_step: int, max_rounds: int) -> None:
        if groups_per_step < 1 or max_rounds < 1:
            raise ValueError(f"groups_per_step and max_rounds must be >= 1 (got {groups_per_step}, {max_rounds})")
        self.max_rejections = (max_rounds - 1) * groups_per_step
        self._rejected_in_a_row = 0
        self._step = {"kept": 0, "dropped": 0, "forced": 0}

    def __call__(self, group: list[Trajectory]) -> bool:
        if is_informative(group):
            self._rejected_in_a_row = 0
            self._step["kept"] += 1
            return True
        if self._rejected_in_a_row >= self.max_rejections:
            self._rejected_in_a_row = 0
            self._step["forced"] += 1
            return True
        self._rejected_in_a_row += 1
        self._step["dropped"] += 1
        return False

    def step_metrics(self) -> dict[str, float]:
        """Counts since the last call (one training step's worth of decisions)."""
        out = {f"dynamic_sampling/{k}_groups": float(v) for k, v in self._step.items()}
        self._step = dict.fromkeys(self._step, 0)
        return out
