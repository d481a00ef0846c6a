"""``run.eval_every=N``: every N steps the current policy plays the env's eval split, logged as ``eval/*``."""

from __future__ import annotations

import json

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.loop import Run, train

SMALL = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
         "env.max_new_tokens_per_turn": 8, "env.max_turns": 1, "run.progress": False}


def test_every_nth_step_logs_the_eval_split(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.steps": 3, "run.eval_every": 2, "run.run_dir": str(tmp_path)})
    records = train(cfg)
    evaluated = [r["step"] for r in records if "eval/reward_mean" in r]
    assert evaluated == [1]  # after the 2nd step (steps are 0-based): the weights of 2 updates
    eval_split = len(build_env(cfg).tasks("eval"))  # each eval task played once
    record = records[1]
    assert record["eval/episodes"] == eval_split and 0.0 <= record["eval/reward_mean"] <= 1.0
    assert record["time/eval"] > 0
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(k for k in r if k.startswith("eval/")) for r in logged][1] == sorted(
        k for k in record if k.startswith("eval/"))
    assert not any(k.startswith("eval/") for r in (logged[0], logged[2]) for k in r)


def test_a_negative_eval_every_is_refused_before_any_work(tmp_path):
    with pytest.raises(UserError, match=r"run.eval_every=-1 is out of range: it must be >= 0"):
        Run(load_config("tiny-cpu", {**SMALL, "run.eval_every": -1, "run.run_dir": str(tmp_path)}))
