"""Supervised engine actors: routing, death under load, restart with the current weights, hangs, colocation."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.models.builder import build_tiny
from miles_agent.runtime.engine_actor import remote_engine_class
from miles_agent.runtime.supervisor import EngineSupervisor

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPT = [5, 17, 42, 8]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny("tiny-qwen3", seed=0)


def make_supervisor(ray, tiny, n=2, **kw):
    model, tok = tiny
    cls = remote_engine_class()
    model_ref, tok_ref = ray.put(copy.deepcopy(model)), ray.put(tok)
    return EngineSupervisor(lambda i: cls.options(num_cpus=1).remote(model_ref, tok_ref, 8, "cpu"), n, **kw)


def perturbed(model, scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


async def wait_ready(sup, timeout=120.0):
    t0 = time.monotonic()
    while not all(s.ready for s in sup._slots):
        assert time.monotonic() - t0 < timeout, "engines did not come back"
        await asyncio.sleep(0.1)


def test_a_killed_engine_aborts_its_requests_and_comes_back_with_current_weights(ray_session, tiny):
    sup = make_supervisor(ray_session, tiny, health_check_interval_s=0.5)

    async def main():
        before = await sup.generate(PROMPT, GREEDY)
        assert len(before.output_ids) == 6 and before.weight_version == 0
        new = perturbed(tiny[0], 0.5)
        await sup.push_weights(new[:5], version=3)  # two buckets of one version: a restart must load both
        metrics = await sup.push_weights(new[5:], version=3)
        assert metrics["sync_engines"] == 2 and len(sup._weights) == 2
        outs = [(await sup.generate(PROMPT, GREEDY)).output_ids for _ in range(2)]
        assert outs[0] == outs[1] and outs[0] != before.output_ids  # both engines serve version 3
        long = SamplingParams(max_new_tokens=2000, temperature=1.0)
        inflight = [asyncio.ensure_future(sup.generate(PROMPT, long)) for _ in range(6)]
        while sup._slots[0].inflight == 0:  # kill it while it holds requests (not after they finished)
            await asyncio.sleep(0.01)
        victim = sup._slots[0].actor
        ray_session.kill(victim)
        results = await asyncio.gather(*inflight)
        aborted = [r for r in results if r.finish_reason is FinishReason.ABORT]
        assert aborted and all(r.output_ids == [] and "infra_error" in r.meta for r in aborted)
        assert sup.stats["aborted_requests"] == len(aborted)
        await wait_ready(sup)
        assert sup._slots[0].actor is not victim and sup.stats["restarts"] == 1
        probe = await sup._slots[0].actor.probe.remote()
        assert probe["weight_version"] == 3
        # The replacement samples exactly what the survivor does: it loaded version 3, not the start weights.
        after = await asyncio.gather(*(s.actor.generate.remote(PROMPT, GREEDY) for s in sup._slots))
        assert after[0].output_ids == after[1].output_ids == outs[0]
        await sup.shutdown()

    asyncio.run(main())


def test_a_hung_engine_is_detected_and_replaced(ray_session, tiny):
    sup = make_supervisor(ray_session, tiny, n=1, health_check_interval_s=0.3, health_check_timeout_s=1.0)

    async def main():
        assert (await sup.generate(PROMPT, GREEDY)).finish_reason is not FinishReason.ABORT
        stuck = sup._slots[0].actor
        stuck.hang.remote(60.0)
        t0 = time.monotonic()
        c = await sup.generate(PROMPT, GREEDY)  # routed to the stuck engine, aborted when it is replaced
        assert c.finish_reason is FinishReason.ABORT
        await wait_ready(sup)
        assert sup._slots[0].actor is not stuck and time.monotonic() - t0 < 60
        assert (await sup.generate(PROMPT, GREEDY)).finish_reason is not FinishReason.ABORT
        await sup.shutdown()

    asyncio.run(main())


def test_colocated_engines_release_memory_for_training_and_take_it_back_at_the_weight_push(ray_session, tiny):
    sup = make_supervisor(ray_session, tiny, n=1, health_check_interval_s=0)

    async def main():
        await sup.generate(PROMPT, GREEDY)
        actor = sup._slots[0].actor
        probe = await actor.probe.remote()
        assert probe["kv_cache_bytes"] > 0 and probe["prefix_cache_bytes"] > 0
        sup.release_memory()
        probe = await actor.probe.remote()
        assert probe["kv_cache_bytes"] == 0 and probe["prefix_cache_bytes"] == 0
        assert probe["released"] and probe["paused"]
        assert (await sup.push_weights(perturbed(tiny[0], 0.1), version=1))["engine_memory_resumed"] == 1
        probe = await actor.probe.remote()
        assert not probe["released"] and not probe["paused"] and probe["weight_version"] == 1
        assert (await sup.generate(PROMPT, GREEDY)).weight_version == 1
        await sup.shutdown()

    asyncio.run(main())


def test_a_replaced_engine_waits_out_of_rotation_for_the_next_push_when_the_trainer_moved_on(ray_session, tiny):
    """With a transport that keeps no copy of the weights (rank 0's broadcast), a replacement asks the
    trainer to resync it; when a train step has changed the weights since the last push, it must not
    serve the initial weights: it stays out of rotation and the next push includes it."""
    sup = make_supervisor(ray_session, tiny, n=2, health_check_interval_s=0.5)
    asked = []

    async def trainer_moved_on(actor):
        asked.append(actor)
        return None

    sup.resync = trainer_moved_on

    async def main():
        await sup.generate(PROMPT, GREEDY)  # binds the supervisor to this loop (its health monitor starts)
        dead = sup._slots[1].actor
        ray_session.kill(dead)
        while not sup._slots[1].waiting:
            await asyncio.sleep(0.1)
        assert asked == [sup._slots[1].actor] and not sup._slots[1].ready
        for _ in range(4):  # only engine 0 serves meanwhile
            assert (await sup.generate(PROMPT, GREEDY)).finish_reason is not FinishReason.ABORT
        assert (await sup._slots[1].actor.probe.remote())["steps"] == 0
        sent_to = []

        async def send(actors):
            sent_to.append(actors)
            await asyncio.gather(*(a.update_weights.remote(perturbed(tiny[0], 0.1), 1) for a in actors))
            return {"sync_bytes": 1.0}, []

        await sup.push_with(send, version=1)
        assert sent_to == [[sup._slots[0].actor, sup._slots[1].actor]] and sup._slots[1].ready
        assert not sup._slots[1].waiting and sup.weight_version == 1
        assert (await sup._slots[1].actor.probe.remote())["weight_version"] == 1
        await sup.shutdown()

    asyncio.run(main())
