"""--resume continues a run from its latest checkpoint: same data position, same weights, log kept in step order."""

from __future__ import annotations

import json

import pytest

from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.loop import Run, train

SMALL = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
         "env.max_new_tokens_per_turn": 8, "run.progress": False, "run.checkpoint_every": 1}


def test_resume_continues_where_the_checkpoint_left_off(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.steps": 2, "run.run_dir": str(tmp_path)})
    train(cfg)
    more = load_config("tiny-cpu", {**SMALL, "run.steps": 3, "run.run_dir": str(tmp_path)})
    run = Run(more, resume=True)
    assert run.step == 2 and run.sampler.position == 2 * 2
    run.trainer.close()
    records = train(more, resume=True)
    assert [r["step"] for r in records] == [2]
    assert records[0]["weight_version"] == 2  # the engine got the checkpoint's weights before sampling
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.run_dir": str(tmp_path)})
    with pytest.raises(UserError, match="no checkpoint in"):
        Run(cfg, resume=True)
