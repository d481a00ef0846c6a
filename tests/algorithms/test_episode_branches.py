"""The episode runner marks every trajectory of one episode (its branches) with one episode id."""

from __future__ import annotations

import asyncio

from miles_agent.algorithms.estimators import estimate
from miles_agent.config import AlgoConfig
from miles_agent.environment import Environment, EnvSession, Harness, Reward, Task
from miles_agent.rollout.episodes import EpisodeRunner, collect
from miles_agent.types import Trajectory


class Session(EnvSession):
    async def score(self, messages):  # pragma: no cover - the harness below scores by itself
        return Reward(0.0)


class Env(Environment):
    name = "branches"

    def tasks(self, split="train"):
        return [Task(id="t", messages=())]

    async def open(self, task, sandbox=None):
        return Session()


class BranchingHarness(Harness):
    """Episode k yields k % 2 + 1 trajectories (a branch after a context rewrite), all scored k % 3 == 0."""

    name = "branching"

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, task, session, policy):
        k, self.calls = self.calls, self.calls + 1
        out = []
        for b in range(k % 2 + 1):
            t = Trajectory(prompt_ids=[1], reward=1.0 if k % 3 == 0 else 0.0)
            t.append_model([2 + b], [-0.5], weight_version=0, turn=0)
            out.append(t)
        return out


def test_branches_share_an_episode_id_and_its_advantage() -> None:
    runner = EpisodeRunner(Env(), BranchingHarness())
    trajs = asyncio.run(collect(runner, [Task(id="t", messages=())], 4, policy=None, concurrency=1))
    # episodes 0..3 yield 1, 2, 1, 2 trajectories; rewards 1, 0, 0, 1
    assert len(trajs) == 6 and len({t.uid for t in trajs}) == 6
    episodes = {}
    for t in trajs:
        episodes.setdefault(t.episode_id, []).append(t)
    assert sorted(len(v) for v in episodes.values()) == [1, 1, 2, 2]
    assert all(len({t.group_id for t in v}) == 1 for v in episodes.values())
    # four episodes, rewards (1, 0, 0, 1): mean 0.5, every branch gets its episode's +-0.5
    adv = [row[0] for row in estimate(AlgoConfig(advantage="grpo", normalize_std=False), trajs)[0]]
    assert adv == [0.5 if t.reward == 1.0 else -0.5 for t in trajs]
