"""R3 under the async scheduler on the real embedded engine (tiny Qwen3-MoE): episodes of the next batch
are mid-flight when a batch is taken and a weight update lands inside their first turn; every trained
trajectory still carries routing, and each of its rows is the one the engine returned for the call
that first ran that token."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

from miles_agent.config import RolloutConfig
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.environment import Environment
from miles_agent.models.builder import build_tiny
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.rollout.routing_capture import RoutingCapture
from miles_agent.scheduling import RolloutScheduler, TaskSampler
from miles_agent.transports import InProcessTransport
from miles_agent.types import SpanKind, Status, Trajectory
from tests.rollout.test_scheduling import PromptsEnv, TwoTurns


class EngineSpy:
    """What the engine returned to each call: full token sequence -> routed experts (copied)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.calls = engine, []

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        c = await self.engine.generate(input_ids, sampling, return_routed_experts=return_routed_experts)
        self.calls.append((tuple(input_ids) + tuple(c.output_ids), np.array(c.routed_experts)))
        return c


def expected_rows(traj: Trajectory, calls: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """Row i from the first call whose sequence covers token i; -1 after the last call."""
    rows = np.full(traj.routed_experts.shape, -1, dtype=np.int32)
    filled = 0
    for span in (s for s in traj.spans if s.kind is SpanKind.MODEL):
        routed = calls.get(tuple(traj.tokens[:len(traj.prompt_ids) + span.end]))
        if routed is not None:  # None: the first half of a call the weights changed under
            rows[filled:len(routed)] = routed[filled:]
            filled = len(routed)
    return rows


@pytest.mark.parametrize("partial", ["keep", "retract"])
def test_episodes_in_flight_across_batches_and_updates_keep_their_routing(tiny_models, partial):
    model, tok = tiny_models["tiny-qwen3-moe"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=16)
    engine.eos_ids = frozenset()
    other, _ = build_tiny("tiny-qwen3-moe", seed=1)  # version 1: other weights, other routing
    spy = EngineSpy(engine)
    capture = RoutingCapture(spy)
    env: Environment = PromptsEnv()
    cfg = RolloutConfig(prompts_per_step=2, samples_per_prompt=2, concurrency=4, mode="async", max_staleness=1,
                        partial_rollout=partial)
    sched = RolloutScheduler(EpisodeRunner(env, TwoTurns()), TaskSampler(env.tasks(), seed=0), engine, [engine],
                             cfg, seed=0, routing=capture)

    async def main():
        batch0, m0 = await sched.next_batch(version=0)  # batch 1's episodes start as batch 0's finish
        target = engine.stats["decode_steps"] + 3
        while engine.stats["decode_steps"] < target:
            await asyncio.sleep(0.001)
        async with sched.weight_update():  # lands inside batch 1's first turns
            await InProcessTransport([engine]).push(other.state_dict().items(), version=1)
        batch1, m1 = await sched.next_batch(version=1)
        await sched.close()
        await engine.shutdown()
        return batch0 + batch1, (m0, m1)

    trained, metrics = asyncio.run(main())
    assert len(trained) == 8 and all(t.status is Status.COMPLETED for t in trained)
    assert [m["routing/missing"] for m in metrics] == [0.0, 0.0]
    assert metrics[1]["multi_version_samples"] == 4  # batch 1: every episode saw both versions
    # Left in the store: only calls of batch 2's episodes, in flight (2 groups x 2 samples x 2 turns).
    assert metrics[1]["routing/stored_calls"] <= 8
    calls = dict(spy.calls)
    assert len(calls) == len(spy.calls)  # no two calls drew the same tokens: the reference is unambiguous
    rerun_differs = 0
    for t in trained:
        assert t.routed_experts.shape == (len(t.tokens) - 1, 4, 2)
        np.testing.assert_array_equal(t.routed_experts, expected_rows(t, calls))
        assert (t.routed_experts[: len(t.tokens) - 2] >= 0).all()  # every token before the last sampled one
        if len(set(t.weight_versions)) > 1:  # turn 1 re-ran turn 0 on version 1: other experts than turn 0's
            turn0_end = len(t.prompt_ids) + next(s.end for s in reversed(t.spans) if s.kind is SpanKind.OBSERVATION)
            last_call = calls[tuple(t.tokens)]
            rerun_differs += int(not np.array_equal(last_call[: turn0_end - 1], t.routed_experts[: turn0_end - 1]))
    # keep: turn 0's rows before the cut are version 0's, which turn 1's re-run on version 1 does not
    # reproduce, so the first call's rows are what was replayed. retract: the engine re-prefilled turn 0
    # on version 1 at the update, so both calls report the same (version-1) routing for it.
    assert rerun_differs == (4 if partial == "keep" else 0)


def test_routing_of_an_abandoned_attempt_is_freed_when_it_ends(tiny_models):
    """partial_rollout=abort restarts episodes whose second turn an update cut: their first turn's call
    is never attached, and is dropped with the attempt; the restarted episode records its own."""
    model, tok = tiny_models["tiny-qwen3-moe"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=16)
    engine.eos_ids = frozenset()
    other, _ = build_tiny("tiny-qwen3-moe", seed=1)
    capture = RoutingCapture(engine)
    env, harness = PromptsEnv(), TwoTurns()
    cfg = RolloutConfig(prompts_per_step=2, samples_per_prompt=2, concurrency=4, mode="async", max_staleness=1,
                        partial_rollout="abort")
    sched = RolloutScheduler(EpisodeRunner(env, harness), TaskSampler(env.tasks(), seed=0), engine, [engine],
                             cfg, seed=0, routing=capture)

    async def main():
        await sched.next_batch(version=0)
        while len(harness.second_turns) <= 4:  # a batch-1 episode is in its second turn
            await asyncio.sleep(0.001)
        held = capture.stored_calls  # that episode's first call, at least
        async with sched.weight_update():  # ... and it is aborted there
            await InProcessTransport([engine]).push(other.state_dict().items(), version=1)
        batch1, m1 = await sched.next_batch(version=1)
        await sched._drain()  # every episode launched so far has ended
        left = capture.stored_calls
        await sched.close()
        await engine.shutdown()
        return batch1, m1, held, left

    batch1, m1, held, left = asyncio.run(main())
    assert held >= 1 and m1["preempted"] >= 1 and m1["routing/missing"] == 0 and len(batch1) == 4
    # A restarted attempt runs on version 1 throughout. On a slow machine other episodes of batch 1 may have
    # finished a turn, or both, before the update and keep version 0 for them (within max_staleness): only a
    # turn the update cut is restarted, never one that ended.
    versions = [t.weight_versions for t in batch1]
    assert [1, 1] in versions and all(v == sorted(v) and set(v) <= {0, 1} for v in versions), versions
    assert left == 0  # nothing kept for the aborted attempts, nor for finished episodes
