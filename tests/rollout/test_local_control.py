"""Pause / resume in all three modes, weight updates, health, shutdown and failure handling."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import hf_greedy, prompts, run_all

from miles_agent.engine import FinishReason, PauseMode, SamplingParams
from miles_agent.models.builder import build_tiny

LONG = SamplingParams(max_new_tokens=40, temperature=0)


@pytest.fixture
def make_engine(make_engine):
    """Engines that ignore EOS: these tests pause requests mid-flight, so every one must run its full length."""

    def make(arch: str = "tiny-qwen3", **kw):
        engine = make_engine(arch, **kw)
        engine.eos_ids = frozenset()
        return engine

    return make


async def wait_steps(engine, n: int) -> None:
    """Let the engine run until it has done at least n decode steps in total."""
    while engine.stats["decode_steps"] < n:
        await asyncio.sleep(0.001)


def test_pause_abort_returns_partial_outputs(make_engine):
    ps = prompts(10, 25, 40, seed=20)
    reference = run_all(make_engine(), ps, LONG)
    engine = make_engine()

    async def main():
        tasks = [asyncio.create_task(engine.generate(p, LONG)) for p in ps]
        await wait_steps(engine, 5)
        await engine.pause(PauseMode.ABORT)
        outs = await asyncio.gather(*tasks)
        late = asyncio.create_task(engine.generate(ps[0], LONG))  # waits while paused
        await asyncio.sleep(0.05)
        assert not late.done()
        await engine.resume()
        return outs, await late

    outs, late = asyncio.run(main())
    for out, ref in zip(outs, reference):
        assert out.finish_reason is FinishReason.ABORT
        assert 0 < len(out.output_ids) < LONG.max_new_tokens
        assert out.output_ids == ref.output_ids[: len(out.output_ids)]
        assert len(out.output_logprobs) == len(out.output_ids)
    assert late.output_ids == reference[0].output_ids
    assert len(engine._free_slots) == engine.max_batch_size


@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.RETRACT])
@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_pause_continue_equals_uninterrupted(mode, arch, make_engine):
    ps = prompts(10, 25, 40, seed=21)
    routed = arch.endswith("moe")
    reference = run_all(make_engine(arch), ps, LONG, return_routed_experts=routed)
    engine = make_engine(arch)

    async def main():
        tasks = [asyncio.create_task(engine.generate(p, LONG, return_routed_experts=routed)) for p in ps]
        await wait_steps(engine, 5)
        await engine.pause(mode)
        steps = engine.stats["decode_steps"]
        await asyncio.sleep(0.05)
        assert engine.stats["decode_steps"] == steps  # frozen while paused
        assert not any(t.done() for t in tasks)
        if mode is PauseMode.RETRACT:
            assert len(engine._free_slots) == engine.max_batch_size  # KV cache dropped
        await engine.resume()
        return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    for out, ref in zip(outs, reference):
        assert out.finish_reason is ref.finish_reason
        assert out.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(out.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4)
        if routed:
            assert (out.routed_experts == ref.routed_experts).all()
    if mode is PauseMode.RETRACT:
        assert engine.stats["retractions"] == len(ps)
        assert all(o.meta["retractions"] == 1 for o in outs)


def test_update_weights_follows_new_model(tiny_models, make_engine):
    other, _ = build_tiny("tiny-qwen3", seed=1)
    base = tiny_models["tiny-qwen3"][0]
    engine = make_engine(weight_version=3)
    p = prompts(12, seed=22)[0]
    before = run_all(engine, [p])[0]
    assert before.output_ids == hf_greedy(base, p, 16) and before.weight_version == 3

    async def update():
        await engine.pause()
        await engine.update_weights(other.state_dict().items(), version=4)
        await engine.resume()

    asyncio.run(update())
    after = run_all(engine, [p])[0]
    assert engine.weight_version == 4 and after.weight_version == 4
    assert after.output_ids == hf_greedy(other, p, 16) != before.output_ids


def test_update_weights_rejects_unknown_name_and_bad_shape(make_engine):
    engine = make_engine()
    good = engine.model.model.norm.weight.detach().clone()

    async def main():
        with pytest.raises(ValueError, match="model.layers.99.mlp.up_proj.weight"):
            await engine.update_weights([("model.norm.weight", good * 2),
                                         ("model.layers.99.mlp.up_proj.weight", good)], version=1)
        with pytest.raises(ValueError, match="shape"):
            await engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)

    asyncio.run(main())
    assert engine.weight_version == 0
    assert torch.equal(engine.model.model.norm.weight, good)  # nothing copied from a rejected bucket


def test_in_place_update_records_both_versions(make_engine):
    other, _ = build_tiny("tiny-qwen3", seed=1)
    engine = make_engine()

    async def main():
        task = asyncio.create_task(engine.generate(prompts(10)[0], LONG))
        await wait_steps(engine, 3)
        await engine.pause(PauseMode.IN_PLACE)
        n = engine.stats["generated_tokens"]
        await engine.update_weights(other.state_dict().items(), version=7)
        await engine.resume()
        return n, await task

    n, out = asyncio.run(main())
    assert out.weight_version == 7
    assert out.meta["weight_versions"] == [(0, 0), (7, n)]


def test_shutdown_aborts_in_flight_and_health(make_engine):
    engine = make_engine()

    async def main():
        assert await engine.health()
        task = asyncio.create_task(engine.generate(prompts(10)[0], LONG))
        await wait_steps(engine, 2)
        await engine.shutdown()
        out = await task
        assert out.finish_reason is FinishReason.ABORT
        assert not await engine.health()
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.generate([1, 2, 3], LONG)

    asyncio.run(main())


def test_step_error_fails_requests_and_engine_keeps_serving(make_engine):
    engine = make_engine()
    real_decode = engine.runner.decode

    def broken(*a, **kw):
        raise RuntimeError("injected decode failure")

    async def main():
        engine.runner.decode = broken
        results = await asyncio.gather(*[engine.generate(p, LONG) for p in prompts(5, 9)],
                                       return_exceptions=True)
        assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results)
        engine.runner.decode = real_decode
        assert await engine.health()
        out = await asyncio.wait_for(engine.generate(prompts(5)[0], LONG), timeout=30)
        assert len(out.output_ids) == LONG.max_new_tokens

    asyncio.run(main())
    assert engine.stats["failed_steps"] >= 1


def test_cancelled_request_frees_its_slot(make_engine):
    engine = make_engine(max_batch_size=2)

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.generate(prompts(10)[0], SamplingParams(max_new_tokens=4000)), 0.05)
        out = await engine.generate(prompts(6)[0], LONG)
        assert len(out.output_ids) == LONG.max_new_tokens
        assert len(engine._free_slots) == 2

    asyncio.run(main())


def test_event_loop_stays_responsive_while_decoding(make_engine):
    engine = make_engine()
    ticks = 0

    async def ticker(stop: asyncio.Event):
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def main():
        stop = asyncio.Event()
        t = asyncio.create_task(ticker(stop))
        await asyncio.gather(*[engine.generate(p, LONG) for p in prompts(10, 20)])
        stop.set()
        await t

    asyncio.run(main())
    assert ticks > engine.stats["decode_steps"]


def test_more_requests_than_slots_queue_and_complete(make_engine):
    engine = make_engine(max_batch_size=3)
    ps = prompts(5, 6, 7, 8, 9, 10, 11, seed=23)
    outs = run_all(engine, ps, SamplingParams(max_new_tokens=8, temperature=0))
    alone = run_all(make_engine(), ps, SamplingParams(max_new_tokens=8, temperature=0))
    assert [o.output_ids for o in outs] == [a.output_ids for a in alone]
    assert engine.mean_decode_batch <= 3


def test_cancel_while_paused_frees_slot_at_once(make_engine):
    engine = make_engine(max_batch_size=2)

    async def main():
        task = asyncio.create_task(engine.generate(prompts(10)[0], SamplingParams(max_new_tokens=4000)))
        await wait_steps(engine, 2)
        await engine.pause(PauseMode.IN_PLACE)
        assert len(engine._free_slots) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(engine._free_slots) == 2
        await engine.resume()

    asyncio.run(main())
