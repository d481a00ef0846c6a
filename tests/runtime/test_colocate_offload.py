"""Colocated Ray run (engine i shares rank i's bundle and GPU): the trainer ranks give their device back
while the engines generate, in the right order around rollout, train and weight sync.

Per step: the engines release their memory -> every rank reloads its state -> trains -> gathers the
weights -> offloads (0 bytes left on its device) -> the engines take their memory back and load the new
weights. Checkpoint and final HF save reload, then offload again. The order is read back from each
rank (its own log, on the machine's monotonic clock) and from the driver's calls to the engines.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import train_then_close

from miles_agent.config import load_config
from miles_agent.loop import Run
from miles_agent.runtime import launch

TINY = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "env.max_new_tokens_per_turn": 6, "env.max_turns": 1, "run.progress": False, "run.steps": 2,
        "cluster.mode": "ray", "cluster.colocate": True, "cluster.num_engines": 1, "train.world_size": 2,
        "cluster.trainer_gpus": 0.5, "cluster.gpus_per_engine": 0.5, "cluster.health_check_interval_s": 0}


def spy(obj, name: str, log: list[tuple[str, float, float]]) -> None:
    """Record (name, start, end) of every call on the machine's monotonic clock (sync or async)."""
    inner = getattr(obj, name)
    if asyncio.iscoroutinefunction(inner):
        async def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return await inner(*args, **kwargs)
            finally:
                log.append((name, t0, time.monotonic()))
    else:
        def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                log.append((name, t0, time.monotonic()))
    setattr(obj, name, timed)


def test_colocated_trainer_ranks_offload_while_engines_generate(ray_session, tmp_path):
    cfg = load_config("tiny-cpu", {**TINY, "run.run_dir": str(tmp_path)})
    run = Run(cfg)
    sess = run.cluster.session
    engines: list[tuple[str, float, float]] = []
    spy(sess.engines, "release_memory", engines)

    async def main():
        try:
            records = await run.train()
            return records, run.trainer.memory_log(), run.trainer.where(), [
                await a.where.remote() for a in sess.engines.actors], await sess.engines.actors[0].memory_log.remote()
        finally:
            await run.engine.shutdown()
            run.trainer.close()

    records, logs, ranks, engine_where, engine_log = asyncio.run(main())
    assert [r["step"] for r in records] == [0, 1] and all(r["train/reload_s"] >= 0 for r in records)
    # the engine really shares rank 0's bundle (the same fake GPU)
    assert ranks[0]["gpu_ids"] and [w["gpu_ids"] for w in engine_where] == [ranks[0]["gpu_ids"]]
    expected = ["offload",  # after setup: the engines generate first
                *["reload", "train_step", "gather", "offload"] * 2,
                "reload", "save_checkpoint", "offload", "reload", "save_hf", "offload"]
    for log in logs:
        assert [e for e, _, _ in log] == expected
        assert all((b == 0) == (e == "offload") for e, _, b in log)  # offloaded: nothing left on the device
        assert log[5][2] == log[2][2]  # step 1's reload brings back all step 0 held, Adam state included
    assert [name for name, _, _ in engines] == ["release_memory"] * 2
    assert [e for e, _ in engine_log] == ["release", "resume"] * 2  # the engine took it back with each push
    for step in range(2):
        _, _, released = engines[step]
        pushed = engine_log[2 * step + 1][1]
        for log in logs:  # this step's (reload, train_step, gather, offload) on every rank
            (_, t_reload, _), _, (_, t_gather, _), (_, t_offload, _) = log[1 + 4 * step: 5 + 4 * step]
            assert released <= t_reload  # the engines freed the device before the rank took it
            assert t_gather <= t_offload <= pushed  # the rank freed it before the engines took it back


def test_a_backend_without_offload_is_refused_before_any_actor_starts(monkeypatch, tmp_path):
    from miles_agent import registry
    from miles_agent.errors import UserError

    class NoOffload:  # a third-party trainer that cannot give its device back
        pass

    monkeypatch.setattr(registry, "load", lambda kind, name: NoOffload)
    cfg = load_config("tiny-cpu", {**TINY, "run.run_dir": str(tmp_path)})
    cluster = launch.RayCluster(cfg)
    with pytest.raises(UserError, match="train.offload=false"):
        cluster.trainer(None, None)
    assert cluster.session is None  # no placement was reserved


def test_offload_also_wraps_rank0_broadcast(ray_session, tmp_path):
    """train.offload=true without colocation, weights broadcast by rank 0 itself: the rank reloads for
    the broadcast and offloads after it, and every engine's checksums still equal rank 0's."""
    cfg = load_config("tiny-cpu", {**TINY, "cluster.colocate": False, "train.offload": True, "train.world_size": 1,
                                   "cluster.trainer_gpus": 0, "cluster.gpus_per_engine": 0, "run.checkpoint_every": 0,
                                   "sync.transport": "distributed", "sync.check": True, "run.run_dir": str(tmp_path)})
    run = Run(cfg)

    records, log = train_then_close(run)
    assert all(r["sync_checked_tensors"] > 0 for r in records)  # the engine holds rank 0's exact weights
    assert [e for e, _, _ in log] == ["offload", *["reload", "train_step", "gather", "offload"] * 2,
                                      "reload", "save_checkpoint", "offload", "reload", "save_hf", "offload"]
    assert all((b == 0) == (e == "offload") for e, _, b in log)
