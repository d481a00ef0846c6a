"""The aci harness on a shipped swe instance in the local sandbox: the model views, searches, makes a
broken edit (refused, file unchanged), fixes the bug by string replacement, runs the tests and submits;
the episode is a valid TITO trajectory scored 1.0 by the hidden tests in a fresh sandbox."""

from __future__ import annotations

import asyncio

from conftest import play, tool_call

from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.harnesses.aci import ACIHarness

ID = "miles-swe__numkit-clamp-upper-bound"


def test_aci_episode_fixes_the_bug_and_refuses_a_broken_edit(swe_env, tokenizer, scripted):
    task = next(t for t in swe_env.tasks("all") if t.id == ID)
    replies = [
        tool_call("search", pattern="def clamp"),
        tool_call("view", path="numkit/stats.py", start=28, end=40),
        tool_call("edit", path="numkit/stats.py", start=34, end=35, content="    if x > hi\n        return hi"),
        tool_call("view", path="numkit/stats.py", start=34, end=35),
        tool_call("replace", path="numkit/stats.py", old="    if x > hi:\n        return lo",
                  new="    if x > hi:\n        return hi"),
        tool_call("run_tests", args="tests"),
        tool_call("submit"),
    ]
    policy = scripted(replies)
    harness = ACIHarness(tokenizer, HarnessLimits(max_turns=20, max_total_tokens=60000, max_observation_tokens=4000),
                         SamplingParams(max_new_tokens=512))
    (traj,), session = asyncio.run(play(swe_env, task, harness, policy))
    traj.validate()
    text = tokenizer.decode(traj.tokens)
    assert "numkit/stats.py:28: def clamp(x, lo, hi):" in text
    assert "34|     if x > hi:" in text
    assert "edit rejected, numkit/stats.py left unchanged: the result does not parse" in text
    assert "[numkit/stats.py edited;" in text and "9 passed" in text
    assert traj.reward == 1.0, session.verdict.reason
    assert traj.reward_parts == {"fail_to_pass": 1.0, "pass_to_pass": 1.0, "patch_applied": 1.0}
    removed = [line for line in session.patch.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert removed == ["-        return lo"] and "+        return hi" in session.patch
    assert all(v == "passed" for v in session.result_details()["tests"].values())
    # Exactly the sampled tokens are trained on, with the engine's logprobs.
    sampled = [i for i, m in zip(traj.tokens[len(traj.prompt_ids):], traj.loss_mask) if m]
    assert sampled == [t for ids in policy.sampled for t in ids]
