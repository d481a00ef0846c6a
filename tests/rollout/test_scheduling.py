"""The rollout scheduler on the real embedded engine: batches are whole groups, no trained sample has a
span older than max_staleness versions, stale samples are counted, and each partial-rollout mode does
what it says when weights change under episodes in flight."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_agent.config import RolloutConfig
from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.environment import Environment, EnvSession, Harness, Reward, Task
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.scheduling import RolloutScheduler, TaskSampler, staleness
from miles_agent.transports import InProcessTransport
from miles_agent.types import SpanKind, Status, Trajectory

TOKENS = 24  # per model turn; the engine ignores EOS, so every turn is exactly this long
OBSERVATION = [5, 6, 7]


def sampled(traj: Trajectory) -> list[int]:
    """The tokens the engine sampled (the model spans, which are what the loss mask keeps)."""
    return [t for t, m in zip(traj.response_ids, traj.loss_mask) if m]


class _Session(EnvSession):
    async def score(self, messages):
        return Reward(0.0)


class PromptsEnv(Environment):
    name = "prompts"
    reward_range = (0.0, 2.0)  # TwoTurns scores sum(sampled) % 3

    def tasks(self, split="train"):
        return [Task(id=f"t{i}", messages=(), info={"prompt": [10 + i, 20 + i, 30 + i, 40]}) for i in range(6)]

    async def open(self, task, sandbox=None):
        return _Session()


class TwoTurns(Harness):
    """Model turn, a fixed observation, model turn; reward from the sampled ids (so groups vary)."""

    name = "two-turns"

    def __init__(self) -> None:
        self.second_turns: list[list[int]] = []  # the span versions an episode had when it began turn 1

    async def run(self, task, session, policy):
        traj = Trajectory(prompt_ids=list(task.info["prompt"]), task_id=task.id)
        for turn in range(2):
            if turn == 1:
                self.second_turns.append(traj.weight_versions)
            c = await policy.generate(list(traj.tokens), SamplingParams(max_new_tokens=TOKENS))
            if c.finish_reason is FinishReason.ABORT:
                traj.status = Status.ABORTED
                return [traj]
            traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn,
                              version_starts=c.meta.get("weight_versions"))
            if turn == 0:
                traj.append_observation(OBSERVATION, turn)
        traj.reward = float(sum(sampled(traj)) % 3)
        return [traj]


@pytest.fixture
def setup(tiny_models):
    model, tok = tiny_models["tiny-qwen3"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=16)
    engine.eos_ids = frozenset()
    other, _ = build_tiny("tiny-qwen3", seed=1)  # "new weights": a different init, so versions differ in logprobs

    def make(**rollout) -> RolloutScheduler:
        cfg = RolloutConfig(prompts_per_step=2, samples_per_prompt=2, concurrency=4, **rollout)
        env = PromptsEnv()
        return RolloutScheduler(EpisodeRunner(env, TwoTurns()), TaskSampler(env.tasks(), seed=0), engine,
                                [engine], cfg, seed=0)

    async def push(sched: RolloutScheduler, version: int) -> None:
        weights = model.state_dict() if version % 2 == 0 else other.state_dict()
        async with sched.weight_update():
            await InProcessTransport([engine]).push(weights.items(), version=version)

    async def decode_steps(n: int) -> None:
        """Wait until the engine has decoded ``n`` more steps (episodes are mid-turn)."""
        target = engine.stats["decode_steps"] + n
        while engine.stats["decode_steps"] < target:
            await asyncio.sleep(0.001)

    yield make, push, decode_steps, engine, model, other
    asyncio.run(engine.shutdown())


def teacher_forced_logprobs(model, traj: Trajectory) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([traj.tokens])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(traj.tokens[1:])[:, None])[:, 0]
    return logp[len(traj.prompt_ids) - 1:].tolist()


def model_spans(traj: Trajectory) -> list[tuple[int, int, int]]:
    return [(s.start, s.end, s.weight_version) for s in traj.spans if s.kind is SpanKind.MODEL]


def test_sync_batches_are_whole_groups_in_task_order(setup):
    make, _, _, _, _, _ = setup
    sched = make(mode="sync")

    async def main():
        first, m = await sched.next_batch(version=0)
        second, _ = await sched.next_batch(version=0)
        await sched.close()
        return first, second, m

    first, second, m = asyncio.run(main())
    order = [t.id for t in TaskSampler(PromptsEnv().tasks(), seed=0).take(4)]
    assert [t.task_id for t in first] == [order[0]] * 2 + [order[1]] * 2
    assert [t.task_id for t in second] == [order[2]] * 2 + [order[3]] * 2
    assert len({t.group_id for t in first + second}) == 4
    assert all(t.weight_versions == [0, 0] and t.response_length == 2 * TOKENS + 3 for t in first + second)
    assert max(staleness(t, 0) for t in first + second) == 0 and m["stale_recycled"] == 0
    # Two samples of one task are different draws: their seeds differ by sample index.
    assert sampled(first[0]) != sampled(first[1])


def test_one_step_off_push_waits_for_the_batch_in_flight(setup):
    make, push, _, _, _, _ = setup
    sched = make(mode="one_step_off")

    async def main():
        batch0, _ = await sched.next_batch(version=0)
        await push(sched, 1)  # batch 1 was generated during "training"; it ends on version 0
        batch1, m1 = await sched.next_batch(version=1)
        await sched.close()
        return batch0, batch1, m1

    batch0, batch1, m1 = asyncio.run(main())
    assert all(t.weight_versions == [0, 0] for t in batch0 + batch1)
    assert {staleness(t, 1) for t in batch1} == {1} and m1["multi_version_samples"] == 0


@pytest.mark.parametrize("partial", ["keep", "retract"])
def test_kept_and_retracted_episodes_continue_on_the_new_weights(setup, partial):
    make, push, decode_steps, engine, old, new = setup
    sched = make(mode="async", max_staleness=1, partial_rollout=partial)

    async def main():
        await sched.next_batch(version=0)  # batch 1 starts as batch 0's episodes free the semaphore
        await decode_steps(3)
        await push(sched, 1)
        batch1, m = await sched.next_batch(version=1)
        await sched.close()
        return batch1, m

    batch1, m = asyncio.run(main())
    assert len(batch1) == 4 and m["preempted"] == 0 and m["multi_version_samples"] == 4
    assert engine.stats["retractions"] == (4 if partial == "retract" else 0)
    for t in batch1:
        spans = model_spans(t)
        (start0, cut, v0), (_, end0, v1) = spans[0], spans[1]
        assert (start0, v0, v1) == (0, 0, 1) and 0 < cut < end0 == TOKENS  # turn 0 was cut by the update ...
        assert spans[2][2] == 1 and len(spans) == 3  # ... and turn 1 ran on version 1
        assert t.status is Status.COMPLETED and t.loss_mask.count(1) == 2 * TOKENS
        assert staleness(t, 1) == 1
        # Every token's logprob is the one the weights that sampled it gave (the importance ratio's
        # denominator): version-0 tokens under the old model; with retract, whose KV cache is
        # recomputed, version-1 tokens under the new model too.
        lp_old, lp_new = teacher_forced_logprobs(old, t), teacher_forced_logprobs(new, t)
        assert t.rollout_logprobs[:cut] == pytest.approx(lp_old[:cut], abs=1e-4)
        if partial == "retract":
            assert t.rollout_logprobs[cut:end0] == pytest.approx(lp_new[cut:end0], abs=1e-4)
        turn1 = slice(spans[2][0], spans[2][1])
        assert t.rollout_logprobs[turn1] == pytest.approx(lp_new[turn1], abs=1e-4)


def test_aborted_episodes_are_retried_on_the_new_weights_and_not_lost(setup):
    make, push, decode_steps, _, _, new = setup
    sched = make(mode="async", max_staleness=1, partial_rollout="abort")

    async def main():
        await sched.next_batch(version=0)
        await decode_steps(3)
        await push(sched, 1)
        batch1, m = await sched.next_batch(version=1)
        await sched.close()
        return batch1, m

    batch1, m = asyncio.run(main())
    assert m["preempted"] == 4  # every episode in flight was aborted once ...
    assert len(batch1) == 4 and len({(t.group_id, tuple(t.tokens)) for t in batch1}) == 4  # ... and none lost
    for t in batch1:
        assert t.status is Status.COMPLETED and t.weight_versions == [1, 1]  # restarted whole on version 1
        assert t.rollout_logprobs == pytest.approx(
            [lp if m else 0.0 for lp, m in zip(teacher_forced_logprobs(new, t), t.loss_mask)], abs=1e-4)


@pytest.mark.parametrize("policy", ["recycle", "drop"])
def test_finished_samples_too_old_for_the_trainer_are_recycled_or_dropped(setup, policy):
    make, push, _, _, _, _ = setup
    sched = make(mode="async", max_staleness=1, stale=policy)

    async def main():
        await sched.next_batch(version=0)
        await sched._drain()  # batch 1 finishes entirely on version 0 ...
        await push(sched, 1)
        await push(sched, 2)  # ... and is two versions old by the time the trainer is at version 2
        batches = [await sched.next_batch(version=2)]
        if policy == "recycle":
            batches.append(await sched.next_batch(version=2))
        await sched.close()
        return batches

    batches = asyncio.run(main())
    trained = [t for trajs, _ in batches for t in trajs]
    assert all(staleness(t, 2) <= 1 and 0 not in t.weight_versions for t in trained)
    metrics = batches[0][1]
    if policy == "recycle":
        assert metrics["stale_recycled"] == 4 and metrics["stale_dropped"] == 0
        # The recycled groups come back re-run, not lost: positions 2..5 are all trained on.
        assert sorted({t.group_id.split("-")[0] for t in trained}) == ["p2", "p3", "p4", "p5"]
    else:
        assert metrics["stale_dropped"] == 4 and metrics["groups_dropped"] == 2
        assert {t.group_id.split("-")[0] for t in trained} <= {"p4", "p5", "p6", "p7"}


def test_an_episode_past_the_bound_mid_flight_is_stopped_and_recycled(setup):
    make, push, decode_steps, _, _, _ = setup
    sched = make(mode="async", max_staleness=1, partial_rollout="keep")
    harness = sched.runner.harness

    async def main():
        await sched.next_batch(version=0)
        await decode_steps(3)
        await push(sched, 1)
        await push(sched, 2)  # the turn in flight began on version 0: two versions old when it returns
        batch, m = await sched.next_batch(version=2)
        await sched.close()
        return batch, m

    batch, m = asyncio.run(main())
    assert m["stale_recycled"] >= 4
    # Checked per generated span: no episode went on to its next turn holding a span two versions old.
    assert harness.second_turns and not any(0 in v and max(v) >= 2 for v in harness.second_turns)
    assert all(0 not in t.weight_versions and staleness(t, 2) <= 1 for t in batch)


def test_bad_scheduling_settings_are_clear_errors(setup):
    make = setup[0]
    with pytest.raises(UserError, match="rollout.mode='later'"):
        make(mode="later")
    with pytest.raises(UserError, match="max_staleness >= 1"):
        make(mode="one_step_off", max_staleness=0)
    with pytest.raises(UserError, match="partial_rollout='pause'"):
        make(partial_rollout="pause")
    with pytest.raises(UserError, match="recycle"):
        make(stale="keep")


def test_a_group_filter_replaces_rejected_groups_with_new_tasks(setup):
    make = setup[0]
    sched = make(mode="sync")
    sched.keep_group = lambda trajs: trajs[0].task_id != order[0]  # reject the first task's group

    async def main():
        batch, m = await sched.next_batch(version=0)
        await sched.close()
        return batch, m

    order = [t.id for t in TaskSampler(PromptsEnv().tasks(), seed=0).take(3)]
    batch, m = asyncio.run(main())
    assert m["groups_filtered"] == 1
    assert [t.task_id for t in batch] == [order[1]] * 2 + [order[2]] * 2
