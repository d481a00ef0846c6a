"""DAPO dynamic sampling: zero-variance groups are dropped and the batch is refilled to size."""

from __future__ import annotations

import asyncio

from miles_agent.algorithms.dynamic_sampling import InformativeGroupFilter, dynamic_sample, is_informative
from miles_agent.types import Status, Trajectory


def group(name: str, rewards: list[float], episodes: list[str] | None = None) -> list[Trajectory]:
    out = []
    for i, r in enumerate(rewards):
        t = Trajectory(prompt_ids=[1], group_id=name, reward=r)
        if episodes:
            t.episode_id = episodes[i]
        out.append(t)
    return out


class ScriptedRollout:
    """Returns pre-made groups in order, as many as asked for per round; records the requests."""

    def __init__(self, groups: list[list[Trajectory]]) -> None:
        self.groups, self.requests = list(groups), []

    async def __call__(self, n: int, round_: int) -> list[Trajectory]:
        self.requests.append((n, round_))
        taken, self.groups = self.groups[:n], self.groups[n:]
        return [t for g in taken for t in g]


def run(rollout: ScriptedRollout, num_groups: int, max_rounds: int = 4):
    return asyncio.run(dynamic_sample(rollout, num_groups, max_rounds))


def test_zero_variance_groups_are_dropped_and_the_batch_refilled() -> None:
    rollout = ScriptedRollout([group("a", [1, 1, 1]), group("b", [0, 1]), group("c", [0, 0, 0, 0]),
                               group("d", [1, 0, 1]),  # round 1 asks for 2 more: d kept, e dropped
                               group("e", [0, 0]), group("f", [2, 1]), group("g", [3, 4])])
    trajs, m = run(rollout, num_groups=3)
    assert rollout.requests == [(3, 0), (2, 1), (1, 2)]
    assert [t.group_id for t in trajs] == ["b", "b", "d", "d", "d", "f", "f"]
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/dropped_groups"] == 3
    assert m["dynamic_sampling/kept_groups"] == 3 and m["dynamic_sampling/unfilled"] == 0
    assert [t.group_id for g in rollout.groups for t in g] == ["g", "g"]  # g was never rolled out


def test_max_rounds_trains_on_what_it_has_and_all_flat_falls_back() -> None:
    rollout = ScriptedRollout([group("a", [1, 0]), group("b", [1, 1]), group("c", [0, 0])])
    trajs, m = run(rollout, num_groups=2, max_rounds=2)
    assert {t.group_id for t in trajs} == {"a"} and m["dynamic_sampling/unfilled"] == 1
    flat = ScriptedRollout([group("x", [1, 1]), group("y", [0, 0])])
    trajs, m = run(flat, num_groups=1, max_rounds=2)
    assert [t.group_id for t in trajs] == ["y", "y"] and m["dynamic_sampling/fallback"] == 1.0


def test_variance_is_judged_per_episode_and_over_scored_members() -> None:
    # two branches of one episode with different rewards are still one episode: no baseline
    assert not is_informative(group("a", [1, 0], episodes=["e", "e"]))
    assert is_informative(group("a", [1, 0], episodes=["e", "f"]))
    g = group("a", [1, 0])
    g[1].status, g[1].reward = Status.FAILED, None  # a failed episode does not count
    assert not is_informative(g)


def test_streaming_filter_rejects_flat_groups_and_forces_one_after_its_budget() -> None:
    keep = InformativeGroupFilter(groups_per_step=2, max_rounds=2)  # at most 2 rejections in a row
    decisions = [keep(group(f"g{i}", r)) for i, r in
                 enumerate([[1, 0], [1, 1], [0, 0], [0, 0], [1, 1], [0, 1]])]
    assert decisions == [True, False, False, True, False, True]
    assert keep.step_metrics() == {"dynamic_sampling/kept_groups": 2.0, "dynamic_sampling/dropped_groups": 3.0,
                                   "dynamic_sampling/forced_groups": 1.0}
    assert keep.step_metrics()["dynamic_sampling/kept_groups"] == 0.0  # counts restart each step
