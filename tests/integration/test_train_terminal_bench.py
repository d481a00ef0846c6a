"""`miles-agent train --env terminal-bench` runs end to end on the embedded defaults: tiny model, local
bubblewrap sandbox, terminal harness; every trajectory passes validate() (the loop checks each one)."""

from __future__ import annotations

import json

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.harnesses.terminal import TerminalHarness
from miles_agent.loop import train
from miles_agent.tito import ChatRenderer


def test_terminal_bench_trains_end_to_end(tmp_path):
    cfg = load_config("tiny-cpu", {"env.name": "terminal-bench", "run.steps": 2, "run.run_dir": str(tmp_path),
                                   "run.progress": False, "rollout.prompts_per_step": 3,
                                   "rollout.samples_per_prompt": 2, "env.max_new_tokens_per_turn": 48})
    records = train(cfg)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["episodes"] == 6 and r["failed"] == 0
        assert 0.0 <= r["reward_mean"] <= 1.0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert (tmp_path / "final" / "config.json").is_file()


@pytest.mark.parametrize("family", ["shipped", "starter"])
def test_terminal_bench_prompts_fit_the_recipe(tokenizer, family):
    """The recipe's token budget leaves room to act on every task of both families."""
    cfg = load_config("tiny-cpu", {"env.name": "terminal-bench", "env.options.family": family})
    env = build_env(cfg)
    assert env.family == family
    harness = TerminalHarness(tokenizer, HarnessLimits(), SamplingParams())
    renderer = ChatRenderer(tokenizer, None)
    longest = max(len(renderer.prompt_ids(harness.opening_messages(t))) for t in env.tasks("all"))
    assert longest + 4 * cfg.env.max_new_tokens_per_turn < cfg.env.max_total_tokens, longest
