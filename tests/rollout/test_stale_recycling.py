"""``rollout.max_recycles``: a sample that is stale every time it runs is re-run at most that many times,
then dropped and counted (``stale_gave_up``); its group is replaced by a new task, and the cap survives a
checkpoint. The engine is a fake that answers at once: prompts of a "slow" task come back sampled two
weight versions ago, as if two updates landed while they generated, so with max_staleness=1 that task's
episodes are always too stale."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from miles_agent.config import RolloutConfig
from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.environment import Environment, EnvSession, Harness, Reward, Task
from miles_agent.errors import UserError
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.scheduling import RolloutScheduler, TaskSampler, check_config
from miles_agent.types import Trajectory

VERSION = 5


class _Session(EnvSession):
    async def score(self, messages):
        return Reward(1.0)


class SixTasks(Environment):
    name = "six"

    def tasks(self, split="train"):
        return [Task(id=f"t{i}", messages=(), info={"prompt": [100 + i, 7]}) for i in range(6)]

    async def open(self, task, sandbox=None):
        return _Session()


class OneTurn(Harness):
    name = "one-turn"

    async def run(self, task, session, policy):
        traj = Trajectory(prompt_ids=list(task.info["prompt"]), task_id=task.id)
        c = await policy.generate(list(traj.tokens), SamplingParams(max_new_tokens=2))
        traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn=0)
        traj.reward = 1.0
        return [traj]


class LaggingEngine:
    """Answers at once at version ``VERSION``, except prompts of ``slow`` tasks: sampled two versions
    ago. After ``block_slow_after`` slow answers, further slow requests wait (episodes in flight)."""

    def __init__(self, slow: set[int], block_slow_after: int | None = None) -> None:
        self.weight_version = VERSION
        self.slow, self.block_slow_after, self.slow_calls = slow, block_slow_after, 0

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        await asyncio.sleep(0)  # a real engine yields to the event loop; so must an always-stale episode
        lag = 0
        if input_ids[0] in self.slow:
            if self.block_slow_after is not None and self.slow_calls >= self.block_slow_after:
                await asyncio.Event().wait()
            self.slow_calls += 1
            lag = 2
        return Completion([1, 2], [-0.5, -0.5], FinishReason.STOP, self.weight_version - lag, len(input_ids))


def order(n: int) -> list[str]:
    return [t.id for t in TaskSampler(SixTasks().tasks(), seed=0).take(n)]


def scheduler(engine, **rollout) -> RolloutScheduler:
    cfg = RolloutConfig(prompts_per_step=2, samples_per_prompt=2, concurrency=8, max_staleness=1, **rollout)
    env = SixTasks()
    return RolloutScheduler(EpisodeRunner(env, OneTurn()), TaskSampler(env.tasks(), seed=0), engine, [engine],
                            cfg, seed=0)


def slow_prompt(task_id: str) -> int:
    return 100 + int(task_id[1:])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_always_stale_sample_is_given_up_after_max_recycles(mode):
    first = order(1)[0]
    engine = LaggingEngine({slow_prompt(first)})
    sched = scheduler(engine, mode=mode, max_recycles=2)

    async def main():
        batches = [await asyncio.wait_for(sched.next_batch(version=VERSION), timeout=10) for _ in range(2)]
        left = dict(sched.counts)  # async: what happened after the last batch was taken
        await sched.close()
        return batches, left

    batches, left = asyncio.run(main())
    total = {k: sum(m[k] for _, m in batches) + left[k]
             for k in ("stale_recycled", "stale_gave_up", "stale_dropped", "groups_dropped")}
    # Both samples of the slow task: 2 recycles each, then stale a third time and given up.
    assert total == {"stale_recycled": 4, "stale_gave_up": 2, "stale_dropped": 0, "groups_dropped": 1}
    assert engine.slow_calls == 6
    trained = [t.task_id for trajs, _ in batches for t in trajs]
    assert first not in trained and len(trained) == 8
    if mode == "sync":  # the emptied group's place in batch 0 went to the next task of the stream
        assert [t.task_id for t in batches[0][0]] == [order(2)[1]] * 2 + [order(3)[2]] * 2


def test_drop_counts_as_dropped_not_given_up():
    first = order(1)[0]
    sched = scheduler(LaggingEngine({slow_prompt(first)}), mode="sync", stale="drop")

    async def main():
        _, m = await asyncio.wait_for(sched.next_batch(version=VERSION), timeout=10)
        await sched.close()
        return m

    m = asyncio.run(main())
    assert (m["stale_dropped"], m["stale_gave_up"], m["stale_recycled"], m["groups_dropped"]) == (2, 0, 0, 1)


def test_the_recycle_count_survives_a_checkpoint():
    """Stopped while the slow samples are in flight after 1 recycle between them, resumed: they get the
    recycles they had left, not max_recycles more."""
    first = order(1)[0]
    engine = LaggingEngine({slow_prompt(first)}, block_slow_after=2)
    sched = scheduler(engine, mode="sync", max_recycles=3)

    async def before():
        job = asyncio.create_task(sched.next_batch(version=VERSION))
        while engine.slow_calls < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        state = sched.state_dict()
        job.cancel()
        await sched.close()
        return state

    state = asyncio.run(before())
    slots = next(g for g in state["groups"] if g["task_id"] == first)["slots"]
    assert sum(s["recycles"] for s in slots) == 2 and state["counts"]["stale_recycled"] == 2

    resumed_engine = LaggingEngine({slow_prompt(first)})
    resumed = scheduler(resumed_engine, mode="sync", max_recycles=3)
    resumed.load_state_dict(state)

    async def after():
        _, m = await asyncio.wait_for(resumed.next_batch(version=VERSION), timeout=10)
        await resumed.close()
        return m

    m = asyncio.run(after())
    # 6 recycles allowed in all, 2 used before the checkpoint (their count is carried in `counts` too);
    # 4 more, then each sample is stale once more and given up.
    assert resumed_engine.slow_calls == 4 + 2
    assert (m["stale_recycled"], m["stale_gave_up"], m["groups_dropped"]) == (6, 2, 1)


def test_a_negative_max_recycles_is_a_clear_error():
    with pytest.raises(UserError, match=r"rollout.max_recycles=-1 is negative; set it to 0"):
        check_config(dataclasses.replace(RolloutConfig(), max_recycles=-1))
    check_config(dataclasses.replace(RolloutConfig(), max_recycles=0))
