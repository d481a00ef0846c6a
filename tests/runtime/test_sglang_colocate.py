"""SGLang servers colocated with Ray trainer ranks (fake GPUs, the fake SGLang server of tests/sglang).

The fake behaves as a server started with ``--enable-memory-saver`` does: released memory is unmapped,
so generating, continuing queued requests or writing weights with memory released is refused, and
weights released without a CPU backup are garbage until new ones are loaded. A wrong order of release,
resume, weight update and continue therefore fails these tests; the first one shows the fake refusing
each wrong order, the second runs two training steps and reads back the order every call reached it in.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from miles_agent.config import load_config
from miles_agent.engines.sglang.server import SGLangServer
from miles_agent.loop import Run
from miles_agent.runtime.sglang_colocate import ServerMemory
from miles_agent.transports.groups import free_port

FAKE = Path(__file__).parents[1] / "sglang" / "fake_sglang_server.py"
PROMPT = {"input_ids": [5, 17, 42, 99], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def call(url: str, path: str, payload=None) -> tuple[int, object]:
    req = urllib.request.Request(url + path, data=json.dumps(payload or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/_fake/state", timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def saver_server(tmp_path_factory):
    """A fake server started as ``--enable-memory-saver`` (no CPU backup), from a saved tiny model."""
    from miles_agent.models.builder import build_tiny, save_hf

    folder = tmp_path_factory.mktemp("saver")
    save_hf(*build_tiny("tiny-qwen3"), folder / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = SGLangServer([sys.executable, str(FAKE), "--model-path", str(folder / "model"), "--host", "127.0.0.1",
                           "--port", str(port), "--enable-memory-saver"], url, folder / "fake.log")
    server.start()
    try:
        server.wait_ready(120)
        yield server, url, folder / "model"
    finally:
        server.stop()


def test_the_fake_refuses_every_wrong_memory_order(saver_server):
    _, url, model = saver_server
    status, before = call(url, "/generate", PROMPT)
    assert status == 200
    assert call(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})[0] == 200
    status, body = call(url, "/generate", PROMPT)  # generating on unmapped memory
    assert status == 400 and "released" in body["error"]["message"]
    load = {"model_path": str(model), "weight_version": "1"}
    status, body = call(url, "/update_weights_from_disk", load)  # writing weights into it
    assert status == 400 and not body["success"]
    # resumed but never reloaded: without --enable-weights-cpu-backup the weights are undefined
    assert call(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    assert call(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})[0] == 200
    status, body = call(url, "/generate", PROMPT)
    assert status == 400 and "load weights" in body["error"]["message"]
    assert state(url)["refused"] == 3
    assert call(url, "/update_weights_from_disk", load)[0] == 200  # the right order: weights, then generate
    status, after = call(url, "/generate", PROMPT)
    assert status == 200 and after["output_ids"] == before["output_ids"]
    # a request queued while paused must not run before the KV cache is back
    assert call(url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200

    async def queue_then_continue():
        queued = asyncio.get_running_loop().run_in_executor(None, call, url, "/generate", PROMPT)
        while state(url)["waiting"] == 0:
            await asyncio.sleep(0.05)
        refused = call(url, "/continue_generation")  # too early
        assert call(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        return refused, call(url, "/continue_generation"), await queued

    refused, continued, queued = asyncio.run(queue_then_continue())
    assert refused[0] == 500 and continued[0] == 200 and state(url)["refused"] == 4
    assert queued[0] == 200 and queued[1]["output_ids"] == before["output_ids"]


def test_a_server_that_dies_while_released_comes_back_and_nothing_stale_is_resumed(saver_server):
    """The actor's side (`ServerMemory`): a restarted server holds all its memory again, so resuming
    tags it never released (a KeyError that kills a real SGLang scheduler) must not be sent."""
    server, url, _ = saver_server
    memory = ServerMemory(server, url)
    seen = len(state(url)["events"])
    assert memory.release(60) == ["cuda_graph", "kv_cache", "weights"]
    assert [(e["call"], e.get("mode") or e.get("tags")) for e in state(url)["events"][seen:]] == [
        ("pause_generation", "retract"), ("release_memory_occupation", ["kv_cache", "weights", "cuda_graph"])]
    os.killpg(server._proc.pid, signal.SIGKILL)  # dies while the trainer trains
    server._proc.wait()
    assert memory.resume(["weights"], 60) == [] and server.restarts == 1  # restarted, nothing to resume
    assert state(url)["events"] == [] and state(url)["released"] == []
    assert memory.release(60) and memory.resume(["weights"], 60) == ["weights"]
    assert memory.resume(["weights"], 60) == []  # resumed once only
    assert [e["tags"] for e in state(url)["events"] if e["call"] == "resume_memory_occupation"] == [["weights"]]


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_colocated_sglang_servers_give_the_device_to_the_trainer_every_step(ray_session, tmp_path, transport):
    cfg = load_config("tiny-cpu", {
        "model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "env.max_new_tokens_per_turn": 6, "env.max_turns": 1, "run.progress": False, "run.steps": 2,
        "run.run_dir": str(tmp_path / "run"), "cluster.mode": "ray", "cluster.colocate": True,
        "cluster.num_engines": 1, "cluster.trainer_gpus": 0.5, "cluster.gpus_per_engine": 0.5,
        "rollout.engine": "sglang", "sglang.launch_command": f"{sys.executable} {FAKE}", "sync.transport": transport,
        "sglang.startup_timeout_s": 120})
    run = Run(cfg)
    sess = run.cluster.session
    actor = sess.engines.engines[0].process.actor
    url = run.engine.url

    async def main():
        try:
            records = await run.train()
            return records, state(url), run.trainer.memory_log()[0], run.trainer.where()[0], \
                await actor.placement.remote()
        finally:
            await run.engine.shutdown()
            run.trainer.close()

    records, fake, rank, rank_where, server_where = asyncio.run(main())
    # server 0 runs in trainer rank 0's bundle, on its (fake) GPU, with SGLang's memory saver
    assert server_where["placement_group"] == rank_where["placement_group"]
    assert rank_where["gpu_ids"] and server_where["gpu_ids"] == rank_where["gpu_ids"]
    assert server_where["cuda_visible_devices"] == ",".join(rank_where["gpu_ids"])
    assert [r["step"] for r in records] == [0, 1] and fake["weight_version"] == 2
    assert fake["refused"] == 0 and not fake["released"] and not fake["weights_lost"]
    # weight loading (whatever calls the transport makes) is folded into one ("load", version) entry
    events = []
    for e in fake["events"]:
        if e["call"].startswith(("update_weights", "init_weights_update_group")):
            if events[-1][0] != "load":
                events.append(("load", None))
            events[-1] = ("load", e.get("weight_version") or events[-1][1])
        else:
            events.append((e["call"], e.get("tags") or e.get("mode")))
    step = [("generate", None), ("pause_generation", "retract"),
            ("release_memory_occupation", ["kv_cache", "weights", "cuda_graph"]),
            ("pause_generation", "in_place"), ("resume_memory_occupation", ["weights"])]
    after = [("resume_memory_occupation", ["kv_cache", "cuda_graph"]), ("continue_generation", None)]
    assert events == [*step, ("load", "1"), *after, *step, ("load", "2"), *after]
    assert all(e["n"] >= 4 for e in fake["events"] if e["call"] == "generate")  # 2 prompts x 2 samples
    # and the trainer rank held the device exactly while the server had released it
    times = {k: [e["t"] for e in fake["events"] if e["call"] == k]
             for k in ("release_memory_occupation", "resume_memory_occupation")}
    ranks = {k: [t for e, t, _ in rank if e == k] for k in ("reload", "offload")}
    for s in range(2):
        assert times["release_memory_occupation"][s] < ranks["reload"][s]
        assert ranks["offload"][s + 1] < times["resume_memory_occupation"][2 * s]  # [0] is the one after setup


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_disaggregated_sglang_servers_get_the_weights_from_trainer_rank_0(ray_session, tmp_path, monkeypatch):
    """sync.transport=distributed with SGLang servers under Ray: rank 0 forms the weight-update group with
    the servers and broadcasts over it; the driver never gathers the weights."""
    from miles_agent.runtime.trainer_actor import RayTrainerGroup

    def no_driver_gather(self):
        raise AssertionError("the driver gathered the weights; rank 0 should have sent them itself")
        yield  # pragma: no cover

    monkeypatch.setattr(RayTrainerGroup, "named_weights", no_driver_gather)
    cfg = load_config("tiny-cpu", {
        "model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "env.max_new_tokens_per_turn": 6, "env.max_turns": 1, "run.progress": False, "run.steps": 2,
        "run.run_dir": str(tmp_path / "run"), "cluster.mode": "ray", "cluster.num_engines": 1,
        "cluster.trainer_gpus": 1, "cluster.gpus_per_engine": 1, "rollout.engine": "sglang",
        "sglang.launch_command": f"{sys.executable} {FAKE}", "sync.transport": "distributed",
        "sglang.startup_timeout_s": 120})
    run = Run(cfg)
    url = run.engine.url

    async def main():
        try:
            return await run.train(), state(url)
        finally:
            await run.engine.shutdown()
            run.trainer.close()

    records, fake = asyncio.run(main())
    assert [r["step"] for r in records] == [0, 1] and fake["weight_version"] == 2 and fake["refused"] == 0
    assert all(r["sync_bytes"] > 0 and r["sync_engines"] == 1 for r in records)
    calls = [e["call"] for e in fake["events"]]
    assert calls.count("init_weights_update_group") == 1  # formed once, reused by the second push
    assert calls.count("update_weights_from_distributed") >= 2
