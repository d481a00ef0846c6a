"""The default Ray weight path (sync.transport=object-store): trainer rank 0 sends the weights bucket by bucket
-- through shared memory to engines on its node, else through ray.put -- and every engine actor loads each
bucket while the next is written (or, once the layout has settled, is told of the push before the bytes are
written and waits for them). When a push returns, every engine holds exactly the trainer's weights at that
version and generates again (unpaused)."""

from __future__ import annotations

import asyncio

import pytest

from miles_agent.config import load_config
from miles_agent.loop import Run
from miles_agent.transports.core import compare_checksums, tensor_checksum

TINY = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "env.max_new_tokens_per_turn": 8, "env.max_turns": 2, "run.progress": False, "run.checkpoint_every": 0,
        "cluster.mode": "ray", "cluster.num_engines": 2, "cluster.health_check_interval_s": 0.5,
        "sync.transport": "object-store", "sync.bucket_mb": 1}


def test_every_bucket_has_loaded_on_every_engine_when_a_push_returns(ray_session, tmp_path):
    cfg = load_config("tiny-cpu", {**TINY, "run.steps": 3, "run.run_dir": str(tmp_path)})
    run = Run(cfg)
    sup = run.engine
    try:
        pushed: list[dict] = []
        push = run.transport.push

        async def push_then_look(named_tensors, version):  # the engines' state the moment the push returns
            stats = await push(named_tensors, version)
            probes = await asyncio.gather(*(s.actor.probe.remote() for s in sup._slots))
            sums = await asyncio.gather(*(s.actor.check_weights.remote() for s in sup._slots))
            expected = {name: tensor_checksum(t) for name, t in run.trainer.named_weights()}
            for i, reply in enumerate(sums):
                compare_checksums(expected, reply["checksums"], engine=f"engine {i}", version=version)
            pushed.append({**stats, "probes": probes})
            return stats

        run.transport.push = push_then_look
        records = asyncio.run(run.train())
        assert len(records) == 3 and len(pushed) == 3
        # the third push has a settled layout: the engines had its handle before rank 0 wrote the bytes
        assert [p["sync_announced"] for p in pushed] == [0.0, 0.0, 1.0]
        for version, p in enumerate(pushed, start=1):
            assert p["sync_buckets"] >= 1 and p["sync_engines"] == 2  # 1 MiB buckets (one load call per
            assert p["sync_shared_buckets"] == p["sync_buckets"]  # segment on few cores), all through shared memory
            assert [(q["weight_version"], q["paused"]) for q in p["probes"]] == [(version, False)] * 2
    finally:
        asyncio.run(sup.shutdown())
        run.trainer.close()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "ray-put"])
def test_an_engine_dead_before_the_push_is_replaced_and_the_push_goes_to_the_others(ray_session, shared_memory):
    """An engine that died unnoticed (no health checks) fails its part loads inside the trainer actor: that
    comes back as a weight-sync failure, not as the trainer rank's death, so the supervisor replaces the
    engine and pushes to the survivor; the replacement then loads the pushed buckets before serving (from
    rank 0's shared memory, or from the object store)."""
    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.models.builder import build_tiny
    from miles_agent.runtime.engine_actor import remote_engine_class
    from miles_agent.runtime.launch import ObjectStoreTransport
    from miles_agent.runtime.supervisor import EngineSupervisor
    from miles_agent.runtime.trainer_actor import RayTrainerGroup

    model, tok = build_tiny("tiny-qwen3", seed=0)
    group = RayTrainerGroup(model, tok, TrainConfig(world_size=1), AlgoConfig(), temperature=1.0, device="cpu",
                            options=lambda rank: {"num_cpus": 1})
    cls = remote_engine_class()
    model_ref, tok_ref = ray_session.put(model), ray_session.put(tok)
    sup = EngineSupervisor(lambda i: cls.options(num_cpus=1).remote(model_ref, tok_ref, 8, "cpu"), 2,
                           health_check_interval_s=0)
    transport = ObjectStoreTransport(sup, group, bucket_bytes=1 << 20, shared_memory=shared_memory)
    victim = sup._slots[1].actor
    ray_session.kill(victim)

    async def main():
        stats = await transport.push(None, 5)
        while not sup._slots[1].ready:  # the replacement starts and loads the refs the push left
            await asyncio.sleep(0.2)
        return stats, await asyncio.gather(*(s.actor.check_weights.remote() for s in sup._slots))

    try:
        stats, sums = asyncio.run(main())
        assert stats["sync_engines"] == 1 and stats["engine_restarts"] == 1
        assert stats["sync_shared_buckets"] == (stats["sync_buckets"] if shared_memory else 0)
        assert shared_memory or stats["sync_buckets"] > 2  # ray.put: several 1 MiB buckets, each its own load
        assert sup._slots[1].actor is not victim and sums[0] == sums[1]
        expected = {name: tensor_checksum(t) for name, t in group.named_weights()}
        compare_checksums(expected, sums[1]["checksums"], engine="the replacement", version=5)
    finally:
        sup.kill()
        group.close()
