"""Colocated SGLang servers with tp_size > 1 (fake GPUs, the fake SGLang server): server i sits in rank
i*tp's bundle and is pointed at the GPUs of ranks i*tp .. i*tp+tp-1, as the recipes' layouts need."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from miles_agent.config import load_config
from miles_agent.loop import Run
from miles_agent.runtime.ray_cluster import bundle_specs

FAKE = Path(__file__).parents[1] / "sglang" / "fake_sglang_server.py"


def test_bundles_of_a_spanning_engine():
    cfg = load_config("qwen3-30b-a3b").cluster
    bundles, ranks, engines = bundle_specs(cfg, 16, engine_span=2)
    assert len(bundles) == 16 and all(b["GPU"] == 1 for b in bundles)  # every bundle reserves one whole GPU
    assert ranks == list(range(16)) and engines == [0, 2, 4, 6, 8, 10, 12, 14]


@pytest.mark.slow  # ~100 s: four trainer ranks and two servers
def test_each_tp_server_sees_the_gpus_of_the_ranks_it_spans(ray_session, tmp_path):
    cfg = load_config("tiny-cpu", {
        "model.warm_start": None, "run.progress": False, "run.run_dir": str(tmp_path / "run"),
        "cluster.mode": "ray", "cluster.colocate": True, "cluster.num_engines": 2, "train.world_size": 4,
        "cluster.trainer_gpus": 0.5, "cluster.gpus_per_engine": 0.5, "rollout.engine": "sglang",
        "sglang.num_servers": 2, "sglang.tp_size": 2, "sglang.launch_command": f"{sys.executable} {FAKE}",
        "sync.transport": "disk", "sglang.startup_timeout_s": 120})
    run = Run(cfg)
    try:
        ranks = run.trainer.where()
        servers = ray_session.get([e.process.actor.placement.remote() for e in run.cluster.session.engines.engines])
    finally:
        asyncio.run(run.engine.shutdown())
        run.trainer.close()
    assert all(len(r["gpu_ids"]) == 1 for r in ranks) and len({r["gpu_ids"][0] for r in ranks}) == 4
    for i, s in enumerate(servers):
        assert s["cuda_visible_devices"] == ",".join(ranks[2 * i]["gpu_ids"] + ranks[2 * i + 1]["gpu_ids"])
        assert s["gpu_ids"] == ranks[2 * i]["gpu_ids"]  # Ray placed it in its first rank's bundle
