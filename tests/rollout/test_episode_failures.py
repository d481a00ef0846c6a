"""Infrastructure failures are re-queued and counted, task failures are returned FAILED, run-level
errors end the run -- and every session is closed whatever happened."""

from __future__ import annotations

import asyncio

import pytest

from miles_agent.environment import Environment, EnvSession, Harness, Reward, Task
from miles_agent.errors import InfraError, RunAborted
from miles_agent.rollout.episodes import EpisodeRunner, collect
from miles_agent.sandbox import SandboxError
from miles_agent.types import Status, Trajectory

TASK = Task(id="t1", messages=({"role": "user", "content": "hi"},))


class Session(EnvSession):
    def __init__(self, env: FakeEnv) -> None:
        self.env = env

    async def score(self, messages):
        return Reward(1.0)

    async def close(self) -> None:
        self.env.closed += 1


class FakeEnv(Environment):
    name = "fake"

    def __init__(self) -> None:
        self.opened = self.closed = 0

    def tasks(self, split="train"):
        return [TASK]

    async def open(self, task, sandbox=None):
        self.opened += 1
        return Session(self)


class ScriptedHarness(Harness):
    """Each attempt takes the next outcome: an exception to raise, "aborted", or "ok"."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes = list(outcomes)

    async def run(self, task, session, policy):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        t = Trajectory(prompt_ids=[1, 2], task_id=task.id, reward=1.0)
        t.append_model([3], [-0.1], weight_version=0, turn=0)
        if outcome == "aborted":
            t.status = Status.ABORTED
        return [t]


def play(outcomes: list, max_retries: int = 3) -> tuple[list[Trajectory], EpisodeRunner, FakeEnv]:
    env = FakeEnv()
    runner = EpisodeRunner(env, ScriptedHarness(outcomes), max_retries=max_retries)
    trajs = asyncio.run(runner.run(TASK, policy=None, group_id="g"))
    return trajs, runner, env


def test_infra_failures_are_retried_and_the_episode_still_counts():
    trajs, runner, env = play([SandboxError("container vanished"), InfraError("env server reset"), "aborted", "ok"])
    assert [t.status for t in trajs] == [Status.COMPLETED] and trajs[0].reward == 1.0
    assert trajs[0].metadata["attempts"] == 4 and trajs[0].group_id == "g"
    assert (runner.stats.retries, runner.stats.aborted, runner.stats.failed) == (3, 0, 0)
    assert env.opened == env.closed == 4


def test_an_episode_that_keeps_failing_on_infra_comes_back_aborted_not_scored():
    trajs, runner, env = play([InfraError("down")] * 3, max_retries=2)
    assert len(trajs) == 1 and trajs[0].status is Status.ABORTED and trajs[0].reward is None
    assert trajs[0].metadata["error"] == "infra: down"
    assert (runner.stats.retries, runner.stats.aborted, runner.stats.failed) == (3, 1, 0)
    assert runner.stats.as_metrics() == {"episode_retries": 3.0, "episode_aborted": 1.0, "episode_failed": 0.0}
    assert env.opened == env.closed == 3


def test_a_task_failure_is_not_retried():
    trajs, runner, env = play([KeyError("answer"), "ok"])
    assert trajs[0].status is Status.FAILED and trajs[0].metadata["error"] == "task: KeyError: 'answer'"
    assert (runner.stats.retries, runner.stats.aborted, runner.stats.failed) == (0, 0, 1)
    assert env.opened == env.closed == 1


def test_run_level_errors_end_the_run():
    with pytest.raises(RunAborted):
        play([RunAborted("trainer died")])


def test_collect_returns_every_episode_in_task_order():
    env = FakeEnv()
    runner = EpisodeRunner(env, ScriptedHarness(["ok", InfraError("x"), "ok", ValueError("bad")]))
    trajs = asyncio.run(collect(runner, [TASK], 3, policy=None, concurrency=1))
    assert [t.status for t in trajs] == [Status.COMPLETED, Status.COMPLETED, Status.FAILED]
    assert runner.stats.retries == 1 and runner.stats.failed == 1
