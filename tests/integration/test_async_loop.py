"""The driver loop in async mode: training overlaps rollout, staleness stays within the bound, every
episode of every step arrives, and a checkpoint taken with episodes in flight resumes (they are
regenerated from their tasks)."""

from __future__ import annotations

import json

from miles_agent.config import load_config
from miles_agent.loop import train

SMALL = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
         "env.max_new_tokens_per_turn": 8, "run.progress": False, "run.checkpoint_every": 1,
         "rollout.mode": "async", "rollout.max_staleness": 1}


def test_async_loop_keeps_staleness_bounded_and_resumes_with_episodes_in_flight(tmp_path):
    records = train(load_config("tiny-cpu", {**SMALL, "run.steps": 3, "run.run_dir": str(tmp_path),
                                             "rollout.partial_rollout": "abort"}))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["episodes"] == 4 and r["failed"] == 0 and r["staleness/max"] <= 1 for r in records)
    assert records[0]["staleness/max"] == 0  # the first batch is sampled by the initial weights

    state = json.loads((tmp_path / "checkpoints" / "step_3" / "loop_state.json").read_text())
    groups = state["scheduler"]["groups"]  # launched for the next batches, not trained on yet
    assert [g["position"] for g in groups] == list(range(6, 6 + len(groups))) and groups
    assert state["scheduler"]["position"] == 6 + len(groups)

    more = load_config("tiny-cpu", {**SMALL, "run.steps": 5, "run.run_dir": str(tmp_path),
                                     "rollout.partial_rollout": "abort"})
    resumed = train(more, resume=True)
    assert [r["step"] for r in resumed] == [3, 4]
    assert all(r["episodes"] == 4 and r["staleness/max"] <= 1 for r in resumed)
    assert resumed[0]["weight_version"] == 3  # the engine got the checkpoint's weights first
