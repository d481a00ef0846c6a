"""SGLang servers as Ray actors: one server per engine bundle, launched and stopped by its actor, on
loopback; the driver's clients speak HTTP to them (the stand-in server is tests/sglang/argv_server.py)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from miles_agent.config import load_config
from miles_agent.runtime import launch

ARGV_SERVER = Path(__file__).parents[1] / "sglang" / "argv_server.py"


def _cfg(tmp_path, **extra):
    return load_config("tiny-cpu", {
        "cluster.mode": "ray", "cluster.num_engines": 2, "cluster.gpus_per_engine": 1, "cluster.trainer_gpus": 1,
        "rollout.engine": "sglang", "sglang.launch_command": f"{sys.executable} {ARGV_SERVER}",
        "sglang.tp_size": 1, "sglang.server_args": {"mem_fraction_static": 0.7},
        "model.hf_checkpoint": str(tmp_path / "model"), "run.run_dir": str(tmp_path / "run"), **extra})


def test_each_engine_bundle_gets_a_server_actor_on_its_own_gpu(ray_session, tmp_path):
    ray = ray_session
    cfg = _cfg(tmp_path)
    cluster = launch.RayCluster(cfg)
    try:
        engines = cluster.engines(None, None)
        sess = cluster.session
        assert len(engines) == 2 and all(e.url.startswith("http://127.0.0.1:") for e in engines)
        for e in engines:  # the server runs with the launch arguments the config asked for
            info = json.loads(urllib.request.urlopen(e.url + "/get_server_info", timeout=30).read())
            argv = info["argv"]
            assert argv[argv.index("--model-path") + 1] == str(tmp_path / "model")
            assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
            assert e.process.alive()
        where = ray.get([e.process.actor.placement.remote() for e in engines])
        assert all(w["placement_group"] == sess.placement.group.id.hex() for w in where)
        assert len({w["cuda_visible_devices"] for w in where}) == 2 and all(w["cuda_visible_devices"] for w in where)
        assert engines[0].generate_urls == [e.url for e in engines]  # requests spread over both servers
        sess.engines.kill()
        assert not any(e.process.alive() for e in engines)
        with pytest.raises(OSError):
            urllib.request.urlopen(engines[0].url + "/health_generate", timeout=5)
    finally:
        cluster.session.close()
