"""`miles-agent train --env swe` runs two steps end to end on the embedded defaults (tiny model, local
sandbox, aci harness, shipped instances); the loop validates every trajectory, and the prompt with the
aci tools fits the token budget the run is given."""

from __future__ import annotations

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.harnesses.aci import TOOLS, ACIHarness
from miles_agent.loop import train
from miles_agent.tito import ChatRenderer

OVERRIDES = {"env.name": "swe", "env.max_total_tokens": 3800, "env.max_new_tokens_per_turn": 48}


@pytest.mark.slow  # about 2 minutes on 2 shared cores
def test_swe_trains_two_steps(tmp_path):
    cfg = load_config("tiny-cpu", {**OVERRIDES, "run.steps": 2, "run.run_dir": str(tmp_path), "run.progress": False,
                                   "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2})
    records = train(cfg)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["episodes"] == 4 and r["failed"] == 0
        assert 0.0 <= r["reward_mean"] <= 1.0
    assert (tmp_path / "final" / "config.json").is_file()


def test_the_aci_prompt_fits_the_budget(tokenizer):
    cfg = load_config("tiny-cpu", OVERRIDES)
    env = build_env(cfg)
    harness = ACIHarness(tokenizer, HarnessLimits(), SamplingParams())
    renderer = ChatRenderer(tokenizer, TOOLS)
    longest = max(len(renderer.prompt_ids(harness.opening_messages(t))) for t in env.tasks("all"))
    assert longest + 4 * cfg.env.max_new_tokens_per_turn < cfg.env.max_total_tokens, longest
