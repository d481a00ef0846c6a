"""R3 in the driver loop when rollout overlaps training (one_step_off, async) on the tiny Qwen3-MoE:
episodes of the next batch are generating while a batch is taken, and still every trained trajectory
replays the routing the engine returned for it (none trained on the trainer's own routing)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from miles_agent.config import load_config
from miles_agent.loop import Run, train
from miles_agent.types import SpanKind
from tests.rollout.test_scheduling_r3 import EngineSpy, expected_rows

RUN = {"model.arch": "tiny-qwen3-moe", "model.warm_start": None, "rollout.prompts_per_step": 2,
       "rollout.samples_per_prompt": 2, "env.max_turns": 2, "env.max_new_tokens_per_turn": 16,
       "run.steps": 3, "run.progress": False, "algo.routing_replay": True, "rollout.max_staleness": 1}


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_overlapped_rollout_trains_every_trajectory_on_the_engines_routing(tmp_path, mode):
    run = Run(load_config("tiny-cpu", {**RUN, "rollout.mode": mode, "run.run_dir": str(tmp_path)}))
    spy = EngineSpy(run.routing.policy)
    run.routing.policy = spy
    trained = []
    train_step = run.trainer.train_step

    def record_batch(batch):
        trained.extend(batch.trajectories)
        return train_step(batch)

    run.trainer.train_step = record_batch

    async def main():
        try:
            return await run.train()
        finally:
            for engine in run.engines:
                await engine.shutdown()
            run.trainer.close()
            run.batches.close()
            run.metrics.close()

    records = asyncio.run(main())
    assert [r["routing/missing"] for r in records] == [0.0, 0.0, 0.0]
    assert len(trained) == 12 and all("routing_missing" not in t.metadata for t in trained)
    calls = dict(spy.calls)
    for t in trained:
        np.testing.assert_array_equal(t.routed_experts, expected_rows(t, calls))
        last = len(t.prompt_ids) + max(s.end for s in t.spans if s.kind is SpanKind.MODEL)
        assert (t.routed_experts[: last - 1] >= 0).all() and (t.routed_experts[last - 1:] == -1).all()
    # Stored between steps: at most the calls of the next batch's episodes (4 episodes x 2 turns).
    assert max(r["routing/stored_calls"] for r in records) <= 8


def test_finished_episodes_keep_their_routing_through_a_checkpoint(tmp_path):
    """One-step-off checkpoints hold the next batch, finished (generated while the step trained): it is
    saved with its routing, so after --resume (a new process: no engine call recorded) it still replays."""
    cfg = {**RUN, "rollout.mode": "one_step_off", "run.checkpoint_every": 1, "run.run_dir": str(tmp_path)}
    train(load_config("tiny-cpu", {**cfg, "run.steps": 2}))
    ckpt = tmp_path / "checkpoints" / "step_2"
    state = json.loads((ckpt / "loop_state.json").read_text())
    saved = [t for g in state["scheduler"]["groups"] for s in g["slots"] for t in s["result"] or ()]
    # the routing sits in a binary side file, named from the JSON (int32 rows, not JSON lists)
    with np.load(ckpt / "routing.npz") as arrays:
        assert len(saved) == 4 and sorted(t["routed_experts"]["array"] for t in saved) == sorted(arrays.files)
        assert all(arrays[k].dtype == np.int32 and arrays[k].ndim == 3 for k in arrays.files)
    resumed = train(load_config("tiny-cpu", {**cfg, "run.steps": 4}), resume=True)
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["routing/missing"] for r in resumed] == [0.0, 0.0]
