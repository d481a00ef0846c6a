"""The embedded engine runs decode steps back to back in one worker-thread hop (fewer thread round trips
per token), yet keeps every step boundary it had: a new request, a cancelled one, a pause or a control
call (score, weight update) is served after the step in flight, never after the rest of the run.

Each test sets the run length far beyond the request, so an engine that ignored a boundary would keep
decoding to the end of the long request and fail the bound."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_agent.engine import FinishReason, PauseMode, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny

LONG = SamplingParams(max_new_tokens=64, temperature=0)
SHORT = SamplingParams(max_new_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny("tiny-qwen3")


@pytest.fixture
def engine(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = tiny
    e = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4)
    e.eos_ids = frozenset()  # every request runs its full length
    e.max_steps_per_hop = 10_000  # a run would cover the whole long request if no boundary stopped it
    yield e
    torch.set_num_threads(threads)


async def started(engine: EmbeddedEngine, steps: int = 3) -> None:
    while engine.stats["decode_steps"] < steps:
        await asyncio.sleep(0.001)


def test_a_run_of_steps_takes_few_hops(engine, monkeypatch):
    hops = []
    steps = engine._steps
    monkeypatch.setattr(engine, "_steps", lambda admitted: (hops.append(1), steps(admitted))[1])
    out = asyncio.run(engine.generate(list(range(1, 20)), LONG))
    assert len(out.output_ids) == LONG.max_new_tokens
    assert engine.stats["decode_steps"] == LONG.max_new_tokens - 1
    assert len(hops) <= 3  # one per token before; now prefill + a run (+ one if the request landed mid-check)


@pytest.mark.parametrize("call", ["pause", "score"])
def test_control_calls_wait_at_most_the_step_in_flight(engine, call):
    async def main():
        task = asyncio.create_task(engine.generate(list(range(1, 20)), LONG))
        await started(engine)
        before = engine.stats["decode_steps"]
        if call == "pause":
            await engine.pause(PauseMode.IN_PLACE)
        else:
            await engine.score(list(range(1, 10)))
        during = engine.stats["decode_steps"] - before
        await engine.resume()
        return during, await task

    during, out = asyncio.run(main())
    assert during <= 1
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == LONG.max_new_tokens


def test_new_request_joins_at_the_next_step(engine):
    async def main():
        first = asyncio.create_task(engine.generate(list(range(1, 20)), LONG))
        await started(engine)
        before = engine.stats["decode_steps"]
        second = await engine.generate(list(range(30, 40)), SHORT)
        waited = engine.stats["decode_steps"] - before
        return waited, second, await first

    waited, second, first = asyncio.run(main())
    # the step in flight, its own prefill (sampling token 1), then 2 decode steps (+1 for the wake-up race)
    assert waited <= 4, waited
    assert len(second.output_ids) == SHORT.max_new_tokens and len(first.output_ids) == LONG.max_new_tokens


def test_cancelled_request_leaves_at_the_next_step(engine):
    async def main():
        task = asyncio.create_task(engine.generate(list(range(1, 20)), LONG))
        await started(engine)
        before = engine.stats["decode_steps"]
        task.cancel()
        while len(engine._free_slots) < engine.max_batch_size:
            await asyncio.sleep(0.001)
        return engine.stats["decode_steps"] - before

    assert asyncio.run(main()) <= 1
