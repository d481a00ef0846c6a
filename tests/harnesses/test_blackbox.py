"""The black-box harness: an agent program that only speaks the OpenAI API plays an arith-tools episode
through the proxy, the environment's verifier scores it, and the trajectory is exactly what was sampled."""

from __future__ import annotations

import asyncio
import sys

import pytest

from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.envs.arith_tools import ArithToolsEnv
from miles_agent.envs.arith_tools.env import CALC_TOOL
from miles_agent.errors import UserError
from miles_agent.harnesses.blackbox import AgentContext, BlackBoxHarness
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.tito import ChatRenderer
from miles_agent.types import SpanKind, Status

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

EXAMPLE = f"{sys.executable} -m miles_agent.harnesses.agents.openai_tool_loop"
CALL = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'


class Scripted:
    """Replies in order; each reply is text (+ EOS) or a ready Completion; remembers the sampled ids."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.sampled = tokenizer, list(replies), []

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        r = self.replies.pop(0)
        if not isinstance(r, Completion):
            ids = self.tokenizer.encode(r, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            r = Completion(ids, [-0.5] * len(ids), FinishReason.STOP, 4, len(input_ids))
        self.sampled.append(r.output_ids)
        return r


def play(tokenizer, policy, agent, limits=None, timeout=120.0, task_index=0):
    env = ArithToolsEnv(num_tasks=8)
    task = env.tasks("train")[task_index]
    harness = BlackBoxHarness(tokenizer, limits or HarnessLimits(), SamplingParams(max_new_tokens=64), agent=agent,
                              agent_timeout_s=timeout)

    async def main():
        runner = EpisodeRunner(env, harness, max_retries=1)
        return await runner.run(task, policy, group_id="g"), runner

    return asyncio.run(main())


def test_agent_program_plays_an_arith_episode_end_to_end(tokenizer):
    policy = Scripted(tokenizer, [CALL, "<answer>ans</answer>"])
    (traj,), _ = play(tokenizer, policy, EXAMPLE)
    assert traj.status is Status.COMPLETED, traj.metadata
    assert traj.reward == 1.0 and traj.reward_parts["tool_calls"] == 1.0 and traj.reward_parts["correct"] == 1.0
    traj.validate()
    spans = [traj.response_ids[s.start:s.end] for s in traj.spans if s.kind is SpanKind.MODEL]
    assert spans == policy.sampled and traj.metadata["agent_exit_code"] == 0
    text = tokenizer.decode(traj.tokens)
    assert "<tool_response>" in text and text.endswith("<answer>ans</answer><|im_end|>")
    # the agent's first request renders to the very prompt the chat-tools harness would use
    task = ArithToolsEnv(num_tasks=8).tasks("train")[0]
    assert traj.prompt_ids == ChatRenderer(tokenizer, [CALC_TOOL]).prompt_ids([dict(m) for m in task.messages])


def test_async_function_agent_with_streaming_gets_the_same_reward(tokenizer):
    from miles_agent.harnesses.agents.openai_tool_loop import solve

    seen = {}

    async def agent(ctx: AgentContext):
        seen["tools"] = [t["function"]["name"] for t in ctx.tools]
        seen["direct"] = await ctx.call_tool("calc", {"expr": "2*3"})
        await solve(ctx.base_url, ctx.api_key, ctx.env_url, stream=True)

    (traj,), _ = play(tokenizer, Scripted(tokenizer, [CALL, "<answer>ans</answer>"]), agent)
    assert (traj.status, traj.reward) == (Status.COMPLETED, 1.0)
    assert seen == {"tools": ["calc"], "direct": "+0006"}


def test_wrong_answer_scores_zero_and_turn_limit_truncates(tokenizer):
    (traj,), _ = play(tokenizer, Scripted(tokenizer, ["<answer>1</answer>"]), EXAMPLE)
    assert (traj.status, traj.reward) == (Status.COMPLETED, 0.0)
    limits = HarnessLimits(max_turns=2)
    (traj,), _ = play(tokenizer, Scripted(tokenizer, [CALL, CALL]), "miles_agent.harnesses.agents.openai_tool_loop:agent",
                      limits=limits)
    assert traj.status is Status.TRUNCATED and traj.num_turns == 2 and traj.reward == 0.0
    assert "turn limit" in traj.metadata["truncated"]


def test_crashing_agent_is_failed_with_its_log_never_scored(tokenizer):
    crash = f"{sys.executable} -c \"import sys; print('agent boom'); sys.exit(3)\""
    (traj,), _ = play(tokenizer, Scripted(tokenizer, []), crash)
    assert traj.status is Status.FAILED and traj.reward is None
    assert traj.metadata["agent_exit_code"] == 3 and "agent boom" in traj.metadata["agent_log"]
    assert "exited with code 3" in traj.metadata["error"]


def test_agent_timeout_kills_it_and_scores_what_there_is(tokenizer):
    async def slow(ctx):
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as c:
            await c.chat.completions.create(model="m", messages=ctx.messages, tools=ctx.tools)
        await asyncio.sleep(60)

    (traj,), _ = play(tokenizer, Scripted(tokenizer, ["<answer>1</answer>"]), slow, timeout=1.0)
    assert traj.status is Status.TRUNCATED and traj.reward == 0.0 and "timed out" in traj.metadata["agent_error"]


def test_engine_abort_retries_the_episode(tokenizer):
    aborted = Completion([65], [-0.3], FinishReason.ABORT, 4, 10)
    policy = Scripted(tokenizer, [aborted, CALL, "<answer>ans</answer>"])
    (traj,), runner = play(tokenizer, policy, "miles_agent.harnesses.agents.openai_tool_loop:agent")
    assert (traj.status, traj.reward, traj.metadata["attempts"]) == (Status.COMPLETED, 1.0, 2)
    assert runner.stats.retries == 1


def test_missing_or_bad_agent_is_a_clear_user_error(tokenizer):
    with pytest.raises(UserError, match="env.agent"):
        BlackBoxHarness(tokenizer, HarnessLimits(), SamplingParams())
    with pytest.raises(UserError, match="cannot load the agent"):
        BlackBoxHarness(tokenizer, HarnessLimits(), SamplingParams(), agent="no_such_module:agent")
    with pytest.raises(UserError, match="not an executable on PATH"):
        BlackBoxHarness(tokenizer, HarnessLimits(), SamplingParams(), agent="no-such-agent-binary --go")


WITHOUT_TORCH = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import asyncio
from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.envs.arith_tools import ArithToolsEnv
from miles_agent.envs.arith_tools.env import CALC_TOOL
from miles_agent.harnesses.blackbox import BlackBoxHarness
from miles_agent.models.tokenizer import build_byte_tokenizer

tok = build_byte_tokenizer()
env = ArithToolsEnv()
task = env.tasks()[0]
harness = BlackBoxHarness(tok, HarnessLimits(), SamplingParams(),
                          agent="miles_agent.harnesses.agents.openai_tool_loop:agent")
async def main():
    session = await env.open(task)
    return await harness.run(task, session, env.oracle_policy(tok))
(traj,) = asyncio.run(main())
traj.validate()
assert traj.reward == 1.0, (traj.reward, traj.metadata)
assert "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
print("ok")
"""


def test_proxy_and_black_box_harness_run_without_torch():
    """Environment workers without torch can host the proxy: the arith oracle plays through it for reward 1."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
