"""The black-box harness runs an external coding agent (a separate program, tests/swe/scripted_fixer.py)
against the swe env: it talks to the model through the proxy and edits the repository through the env's
bash tool; the env scores its git diff with the hidden tests, and the proxy's trajectories validate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import play

from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.types import Status

pytest.importorskip("openai")
pytest.importorskip("aiohttp")


def test_external_agent_fixes_an_instance_through_the_proxy(swe_env, tokenizer, scripted):
    from miles_agent.harnesses.blackbox import BlackBoxHarness

    task = next(t for t in swe_env.tasks("all") if t.id == "miles-swe__numkit-clamp-upper-bound")
    agent = f"python {Path(__file__).with_name('scripted_fixer.py')}"
    harness = BlackBoxHarness(tokenizer, HarnessLimits(max_turns=4, max_total_tokens=8192),
                              SamplingParams(max_new_tokens=32), agent=agent, agent_timeout_s=120)
    policy = scripted(["Let me look at clamp.", "Fixed: clamp returns hi above the range."])
    trajs, session = asyncio.run(play(swe_env, task, harness, policy))
    assert [t.status for t in trajs] == [Status.COMPLETED], trajs[0].metadata
    for t in trajs:
        t.validate()
        assert t.reward == 1.0, session.verdict.reason
    assert "+        return hi" in session.patch
    assert not policy.replies  # the agent asked the model twice
