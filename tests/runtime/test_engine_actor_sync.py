"""`EngineActor.sync_weights`, the supervisor's one-call weight push, and the parts of a push from trainer
rank 0 (no Ray needed: the plain class): it loads the weights as the new version at a step boundary, leaves
the engine serving, reports whether the memory had been released, and a failed load changes nothing and
leaves the engine paused."""

from __future__ import annotations

import asyncio
import copy
import os

import pytest
import torch

from miles_agent.engine import SamplingParams
from miles_agent.models.builder import build_tiny
from miles_agent.runtime.engine_actor import EngineActor
from miles_agent.runtime.packed_weights import pack_weights
from miles_agent.runtime.shared_weights import SharedWeightsWriter, wake_engines
from miles_agent.runtime.store_push import merged

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny("tiny-qwen3")


def perturbed(model):
    """A copy of ``model`` with every parameter moved a little: weights an engine does not hold yet."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return other


def test_sync_weights_loads_the_version_mid_request_and_keeps_serving(tiny):
    model, tok = tiny
    actor = EngineActor(copy.deepcopy(model), tok, 4, "cpu")
    actor.engine.eos_ids = frozenset()
    other = perturbed(model)
    packed = pack_weights(other.state_dict().items())

    async def main():
        task = asyncio.create_task(actor.generate(list(range(1, 30)), GREEDY))
        while actor.engine.stats["decode_steps"] < 3:
            await asyncio.sleep(0.001)
        actor.released = True  # as after release_memory (colocation): reported, then cleared
        was_released = await actor.sync_weights(packed, 7)
        return was_released, await task, await actor.generate(list(range(1, 30)), GREEDY)

    was_released, during, after = asyncio.run(main())
    assert was_released is True and actor.released is False
    assert actor.engine.weight_version == 7 and not actor.engine._paused
    versions = during.meta["weight_versions"]
    assert [v for v, _ in versions] == [0, 7] and 0 < versions[1][1] < GREEDY.max_new_tokens
    assert after.weight_version == 7 and after.meta["weight_versions"] == [(7, 0)]
    for name, t in other.state_dict().items():
        assert torch.equal(actor.engine.model.state_dict()[name], t), name


def test_sync_weights_with_a_bad_tensor_changes_nothing(tiny):
    model, tok = tiny
    actor = EngineActor(copy.deepcopy(model), tok, 4, "cpu")
    before = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    bad = pack_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="shape"):
        asyncio.run(actor.sync_weights(bad, 1))
    assert actor.engine.weight_version == 0 and actor.engine._paused  # as the four separate calls left it
    assert all(torch.equal(before[k], v) for k, v in actor.engine.model.state_dict().items())



def test_a_push_in_parts_pauses_once_loads_every_part_and_resumes_after_the_last(tiny):
    """`sync_weights_part`: the parts of one push may start in any order and at once (an async Ray actor);
    generation stops before the first part touches a weight and resumes only when every part has loaded."""
    model, tok = tiny
    actor = EngineActor(copy.deepcopy(model), tok, 4, "cpu")
    other = perturbed(model)
    parts = pack_weights(other.state_dict().items()).split(64 << 10)
    assert len(parts) > 3
    seen: list[tuple[bool, int]] = []  # (paused, version) whenever a part loads
    load = actor.update_weights

    async def watched(weights, version):
        seen.append((actor.engine._paused, actor.engine.weight_version))
        return await load(weights, version)

    actor.update_weights = watched

    async def main():
        actor.released = True
        order = [2, 0, *range(3, len(parts)), 1]  # the first part to start is not part 0, the last not the last
        results = await asyncio.gather(*(actor.sync_weights_part(parts[i], 9, "push-a", i, len(parts)) for i in order))
        return results, actor.engine._paused

    results, paused_after = asyncio.run(main())
    assert results.count(True) == 1 and results[0] is True  # the call that paused reports the released memory
    assert all(paused for paused, _ in seen) and len(seen) == len(parts)
    assert paused_after is False and actor.engine.weight_version == 9 and actor._parts is None
    for name, t in other.state_dict().items():
        assert torch.equal(actor.engine.model.state_dict()[name], t), name


def test_a_retried_push_counts_its_parts_afresh_and_a_failed_part_leaves_the_engine_paused(tiny):
    model, tok = tiny
    actor = EngineActor(copy.deepcopy(model), tok, 4, "cpu")
    good = pack_weights(model.state_dict().items()).split(64 << 10)
    bad = pack_weights([("model.norm.weight", torch.ones(3))])

    async def main():
        with pytest.raises(ValueError, match="shape"):  # part 0 of 2 of a push that then fails
            await actor.sync_weights_part(bad, 4, "try-1", 0, 2)
        assert actor.engine._paused  # a failed load leaves the engine paused, as sync_weights does
        # the push is retried under a new id: its parts are counted from zero, so it resumes only at its end
        for i, part in enumerate(good):
            await actor.sync_weights_part(part, 4, "try-2", i, len(good))
            assert actor.engine._paused == (i < len(good) - 1)

    asyncio.run(main())
    assert actor.engine.weight_version == 4


@pytest.mark.parametrize("done_first", [False, True], ids=["count-after-parts", "count-before-parts"])
def test_a_push_whose_count_comes_later_resumes_only_when_every_part_has_loaded(tiny, done_first):
    """The trainer sends shared-memory parts with ``parts=0`` as it writes them and the count at the end
    (`sync_weights_done`); Ray may deliver the count before or after the parts."""
    model, tok = tiny
    actor = EngineActor(copy.deepcopy(model), tok, 4, "cpu")
    other = perturbed(model)
    parts = pack_weights(other.state_dict().items()).split(64 << 10)

    async def main():
        if done_first:
            await actor.sync_weights_done("push-c", len(parts))
            assert not actor.engine._paused  # nothing has loaded: nothing paused, nothing resumed
        for i, part in enumerate(parts):
            await actor.sync_weights_part(part, 3, "push-c", i, 0)
            assert actor.engine._paused == (not done_first or i < len(parts) - 1)
        if not done_first:
            await actor.sync_weights_done("push-c", len(parts))

    asyncio.run(main())
    assert not actor.engine._paused and actor.engine.weight_version == 3 and actor._parts is None
    for name, t in other.state_dict().items():
        assert torch.equal(actor.engine.model.state_dict()[name], t), name


def test_an_announced_push_pauses_at_once_and_loads_when_rank_0_has_written_it(tiny):
    """Rank 0 sends the push's one shared-memory handle before it writes (runtime/shared_weights.py): the
    engine pauses and waits for the bytes, loads them once rank 0 wakes it, and resumes. When rank 0 lays
    the push out otherwise after all, that call loads nothing and the engine stays paused until the real
    parts have loaded; when rank 0's write fails, the engine goes on with the weights it has."""
    model, tok = tiny
    actor = EngineActor(copy.deepcopy(model), tok, 4, "cpu")
    writer = SharedWeightsWriter(min_segment_bytes=1 << 20)
    engine_id = f"pid-{os.getpid()}"  # outside Ray the engine listens under its pid
    for _ in range(2):  # the layout settles: one segment of the exact size
        list(writer.write(iter(model.state_dict().items()), bucket_bytes=64 << 10))

    async def rank0_writes(tensors, announced):
        before = actor.engine.weight_version
        await asyncio.sleep(0.2)
        assert actor.engine._paused and actor.engine.weight_version == before  # paused, waiting for the bytes
        handles = await asyncio.to_thread(lambda: list(writer.write(iter(tensors), 64 << 10, announced)))
        wake_engines([engine_id])
        return merged(handles)

    async def main():
        first = perturbed(model)
        announced = writer.announce()
        released, _ = await asyncio.gather(actor.sync_weights_part(announced, 5, "push-a", 0, 1, True),
                                           rank0_writes(first.state_dict().items(), announced))
        assert actor.engine.weight_version == 5 and not actor.engine._paused and actor._parts is None
        for name, t in first.state_dict().items():
            assert torch.equal(actor.engine.model.state_dict()[name], t), name

        second = perturbed(model)
        announced = writer.announce()
        reordered = list(reversed(second.state_dict().items()))  # another layout than announced
        _, handles = await asyncio.gather(actor.sync_weights_part(announced, 6, "push-b", 0, 1, True),
                                          rank0_writes(reordered, announced))
        assert actor.engine._paused and actor.engine.weight_version == 5  # nothing loaded from that call
        for i, handle in enumerate(handles, start=1):  # the real parts, as rank 0 sends them next
            await actor.sync_weights_part(handle, 6, "push-b", i, len(handles))
        assert actor.engine.weight_version == 6 and not actor.engine._paused
        for name, t in second.state_dict().items():
            assert torch.equal(actor.engine.model.state_dict()[name], t), name

        def gather_fails():
            yield from list(perturbed(model).state_dict().items())[:3]
            raise RuntimeError("a trainer rank died in the gather")

        async def rank0_fails(announced):
            await asyncio.sleep(0.2)
            with pytest.raises(RuntimeError, match="gather"):
                await asyncio.to_thread(lambda: list(writer.write(gather_fails(), 64 << 10, announced)))
            wake_engines([engine_id])
            await actor.sync_weights_abandoned("push-c")  # what rank 0 sends when its write fails

        announced = writer.announce()
        await asyncio.gather(actor.sync_weights_part(announced, 7, "push-c", 0, 1, True), rank0_fails(announced))
        assert not actor.engine._paused and actor.engine.weight_version == 6  # serving again, weights untouched
        for name, t in second.state_dict().items():
            assert torch.equal(actor.engine.model.state_dict()[name], t), name
        await actor.shutdown()

    try:
        asyncio.run(main())
    finally:
        writer.close()
