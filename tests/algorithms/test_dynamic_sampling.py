"""DAPO dynamic sampling: zero-variance groups are rejected as they finish (the scheduler refills the batch)."""

from __future__ import annotations

from miles_agent.algorithms.dynamic_sampling import InformativeGroupFilter, is_informative
from miles_agent.types import Status, Trajectory


def group(name: str, rewards: list[float], episodes: list[str] | None = None) -> list[Trajectory]:
    out = []
    for i, r in enumerate(rewards):
        t = Trajectory(prompt_ids=[1], group_id=name, reward=r)
        if episodes:
            t.episode_id = episodes[i]
        out.append(t)
    return out


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
