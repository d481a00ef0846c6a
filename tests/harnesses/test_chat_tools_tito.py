"""TITO invariants of the chat-tools harness: what the trainer sees is exactly what was sampled."""

from __future__ import annotations

import asyncio

from miles_agent.engine import SamplingParams
from miles_agent.environment import EnvSession, HarnessLimits, Reward, Task, ToolError
from miles_agent.harnesses.chat_tools import ChatToolsHarness, parse_tool_calls
from miles_agent.tito import ChatRenderer
from miles_agent.types import SpanKind, Status

ECHO_TOOL = {"type": "function", "function": {"name": "echo", "description": "echo",
                                              "parameters": {"type": "object", "properties": {}}}}
TASK = Task(id="t0", messages=({"role": "system", "content": "sys"}, {"role": "user", "content": "go"}))


class EchoSession(EnvSession):
    tools = [ECHO_TOOL]

    def __init__(self) -> None:
        self.final_messages = None

    async def call_tool(self, name, arguments):
        if name != "echo":
            raise ToolError(f"unknown tool {name}")
        return f"echo:{arguments.get('x', '')}"

    async def score(self, messages):
        self.final_messages = messages
        return Reward(1.0, {"x": 1.0})


DEFAULT_LIMITS = HarnessLimits()


def run(tokenizer, policy, limits=DEFAULT_LIMITS, session=None):
    session = session or EchoSession()
    harness = ChatToolsHarness(tokenizer, limits, SamplingParams(max_new_tokens=64))
    return asyncio.run(harness.run(TASK, session, policy)), session


CALL = '<tool_call>{"name": "echo", "arguments": {"x": "%s"}}</tool_call>'


def test_tokens_are_prompt_plus_sampled_plus_observations(tokenizer, scripted):
    policy = scripted([CALL % "a", CALL % "b" + CALL % "c", "done"])
    (traj,), session = run(tokenizer, policy)
    traj.validate()
    assert traj.status is Status.COMPLETED and traj.reward == 1.0 and traj.num_turns == 3
    # loss mask is 1 exactly on the sampled ids, in order, and one logprob per sampled token
    sampled = [t for t, m in zip(traj.response_ids, traj.loss_mask) if m]
    assert sampled == [i for ids in policy.sampled for i in ids]
    assert [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask) if m] == [-0.5] * len(sampled)
    # every model call saw exactly the trajectory so far: no re-tokenized history
    for call_ids, span in zip(policy.calls, [s for s in traj.spans if s.kind is SpanKind.MODEL]):
        assert call_ids == traj.tokens[: len(traj.prompt_ids) + span.start]
    # and the token history decodes to the whole-conversation render (two tool results share a turn)
    full = ChatRenderer(tokenizer, session.tools).render(session.final_messages, add_generation_prompt=False)
    assert tokenizer.decode(traj.tokens) + "\n" == full
    assert full.count("<tool_response>") == 3 and "echo:b</tool_response>\n<tool_response>echo:c" in full
    assert all(s.weight_version == 3 for s in traj.spans if s.kind is SpanKind.MODEL)


def test_malformed_tool_call_becomes_an_error_observation(tokenizer, scripted):
    policy = scripted(["<tool_call>{not json</tool_call>", CALL % "x", "ok"])
    (traj,), session = run(tokenizer, policy)
    traj.validate()
    tool_msgs = [m["content"] for m in session.final_messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error: malformed tool call")
    assert tool_msgs[1] == "echo:x"


def test_unknown_tool_is_reported_to_the_model(tokenizer, scripted):
    policy = scripted(['<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "ok"])
    (traj,), session = run(tokenizer, policy)
    assert [m["content"] for m in session.final_messages if m["role"] == "tool"] == ["error: unknown tool rm"]


def test_turn_cut_by_length_is_truncated_and_still_valid(tokenizer, scripted):
    policy = scripted(["x" * 200])
    (traj,), _ = run(tokenizer, policy, HarnessLimits(max_new_tokens_per_turn=16))
    traj.validate()
    assert traj.status is Status.TRUNCATED and sum(traj.loss_mask) == 16


def test_turn_limit_truncates(tokenizer, scripted):
    policy = scripted([CALL % i for i in range(5)])
    (traj,), _ = run(tokenizer, policy, HarnessLimits(max_turns=2))
    traj.validate()
    assert traj.status is Status.TRUNCATED and traj.num_turns == 2


def test_long_tool_output_is_cut_and_marked(tokenizer, scripted):
    policy = scripted([CALL % ("y" * 300), "ok"])
    (traj,), session = run(tokenizer, policy, HarnessLimits(max_observation_tokens=32, max_new_tokens_per_turn=512))
    traj.validate()
    assert traj.metadata["observation_truncated"] == 1
    assert "[output truncated" in [m for m in session.final_messages if m["role"] == "tool"][0]["content"]


def test_non_append_only_template_starts_a_new_branch(tokenizer, scripted):
    import copy

    # A template that drops <think>...</think> from earlier assistant turns (as Qwen3's does).
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace(
        "{{ message.content or '' }}",
        "{% if loop.last %}{{ message.content or '' }}{% else %}"
        "{{ (message.content or '').split('</think>')[-1] }}{% endif %}")
    policy = scripted(["<think>hmm</think>" + CALL % "a", "<think>ok</think>done"])
    trajs, _ = run(tok, policy)
    assert len(trajs) == 2
    for t in trajs:
        t.validate()
        assert t.reward == 1.0
    assert "branch_reason" in trajs[0].metadata
    # the second branch's prompt is a fresh render of the rewritten history, without the old thinking
    assert "<think>hmm" not in tok.decode(trajs[1].prompt_ids)


def test_parse_tool_calls():
    calls, errors = parse_tool_calls('a<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"k": 1})] and not errors
    calls, errors = parse_tool_calls("<tool_call>{")
    assert not calls and errors and "unterminated" in errors[0]
