"""The real ``miles-agent train`` with ``--ray-address``: a second driver process joins the test's Ray
instance, places two FSDP2 ranks (gloo) with an engine colocated beside each, and trains 2 steps."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest


def test_cli_trains_two_steps_on_ray(ray_session, tmp_path):
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "miles_agent.cli", "train", "--env", "arith-tools", "--steps", "2",
           "--run-dir", str(tmp_path), "--no-progress", "--ray-address", address,
           "model.warm_start=null", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
           "env.max_new_tokens_per_turn=8", "env.max_turns=2", "train.world_size=2", "cluster.num_engines=2",
           "cluster.colocate=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: reward" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert [r["weight_version"] for r in records] == [0, 1]  # the engines got step 0's weights before step 1
    assert records[-1]["sync_engines"] == 2.0 and records[-1]["engine_restarts"] == 0.0
    # colocated: both engines had released their memory for the train step and took it back at the push
    assert all(r["engine_memory_resumed"] == 2.0 for r in records)
    assert (tmp_path / "final" / "config.json").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["cluster"]["ray_address"] == address
    # The driver left nothing behind on the shared instance: placement groups removed, resources free.
    ray = ray_session
    assert all(p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


@pytest.mark.slow
def test_cli_starts_its_own_loopback_ray_when_given_no_address(tmp_path):
    """No --ray-address: the driver starts Ray on this machine (loopback) and shuts it down at the end."""
    cmd = [sys.executable, "-m", "miles_agent.cli", "train", "--env", "arith-tools", "--steps", "1",
           "--run-dir", str(tmp_path), "--no-progress", "cluster.mode=ray", "model.warm_start=null",
           "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "env.max_new_tokens_per_turn=8",
           "env.max_turns=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and records[0]["sync_engines"] == 1.0
