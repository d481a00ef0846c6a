"""The default Ray weight path (sync.transport=object-store): trainer rank 0 puts the weights in the object
store bucket by bucket and every engine actor loads each bucket while the next is put. When a push returns,
every engine holds exactly the trainer's weights at that version and generates again (unpaused)."""

from __future__ import annotations

import asyncio

from miles_agent.config import load_config
from miles_agent.loop import Run
from miles_agent.transports.core import compare_checksums, tensor_checksum

TINY = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "env.max_new_tokens_per_turn": 8, "env.max_turns": 2, "run.progress": False, "run.checkpoint_every": 0,
        "cluster.mode": "ray", "cluster.num_engines": 2, "cluster.health_check_interval_s": 0.5,
        "sync.transport": "object-store", "sync.bucket_mb": 1}


def test_every_bucket_has_loaded_on_every_engine_when_a_push_returns(ray_session, tmp_path):
    cfg = load_config("tiny-cpu", {**TINY, "run.steps": 2, "run.run_dir": str(tmp_path)})
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
        assert len(records) == 2 and len(pushed) == 2
        for version, p in enumerate(pushed, start=1):
            assert p["sync_buckets"] > 2 and p["sync_engines"] == 2  # several 1 MiB buckets, both engines
            assert [(q["weight_version"], q["paused"]) for q in p["probes"]] == [(version, False)] * 2
    finally:
        asyncio.run(sup.shutdown())
        run.trainer.close()
