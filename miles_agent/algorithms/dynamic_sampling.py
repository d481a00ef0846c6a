"""DAPO dynamic sampling (Yu et al. 2025): train only on groups whose rewards differ.

A group whose episodes all got the same reward has zero advantage under any group baseline, so it
only dilutes the batch. `InformativeGroupFilter` rejects such groups as the streaming scheduler
finishes them, so it rolls out a new task in their place; past its budget of rejections it keeps the
next group whatever its rewards, so a run never stalls on a too-easy task set.

Variance is judged per episode (``episode_id``; branches of one episode count once) over the
trainable members of the group; failed episodes stay with their group (the loop reports them) but do
not count. A group with fewer than two scored episodes has no baseline and is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from miles_agent.types import Status, Trajectory


def is_informative(group: Sequence[Trajectory]) -> bool:
    """At least two scored episodes with different rewards (the mean over an episode's branches)."""
    per_episode: dict[str, list[float]] = {}
    for t in group:
        if t.status in (Status.COMPLETED, Status.TRUNCATED) and t.reward is not None:
            per_episode.setdefault(t.episode_id, []).append(float(t.reward))
    rewards = {round(sum(r) / len(r), 12) for r in per_episode.values()}
    return len(per_episode) >= 2 and len(rewards) >= 2


class InformativeGroupFilter:
    """Dynamic sampling inside the streaming scheduler (``Scheduler.keep_group``): reject groups that
    are not informative, so the scheduler rolls out a new task in their place. After
    ``(max_rounds - 1) * groups_per_step`` rejections in a row the next group is kept whatever its
    rewards (``forced``), DAPO's round limit in streaming form: a too-easy task set slows a run down
    but never stalls it."""

    def __init__(self, groups_per_step: int, max_rounds: int,
                 predicate: Callable[[list[Trajectory]], bool] = is_informative) -> None:
        if groups_per_step < 1 or max_rounds < 1:
            raise ValueError(f"groups_per_step and max_rounds must be >= 1 (got {groups_per_step}, {max_rounds})")
        self.max_rejections = (max_rounds - 1) * groups_per_step
        self._rejected_in_a_row = 0
        self.predicate, self._decided = predicate, {}  # predicate: rollout.group_filter's, on the same budget
        self._step = {"kept": 0, "dropped": 0, "forced": 0}

    def __call__(self, group: list[Trajectory]) -> bool:
        key = tuple(t.uid for t in group)  # the scheduler asks again until the batch is full: decide once
        if key not in self._decided:
            self._decided[key] = self._decide(group)
        return self._decided[key]

    def _decide(self, group: list[Trajectory]) -> bool:
        if self.predicate(group):
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
        self._step, self._decided = dict.fromkeys(self._step, 0), {}
        return out
