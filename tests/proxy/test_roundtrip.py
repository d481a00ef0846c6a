"""The proxy round-trips fuzzed multi-turn sessions token-exactly: every trajectory holds exactly the ids and
logprobs the engine sampled, the loss mask marks exactly those, prompt and observation ids equal one render
of the whole conversation by the chat template, and a rewritten history opens a new, valid branch."""

from __future__ import annotations

import asyncio
import copy
import random

import httpx
import pytest
from fuzz_agent import RawClient, fuzz_session
from proxy_helpers import FuzzEngine, RecordingPolicy, check_branch

from miles_agent.engine import SamplingParams
from miles_agent.harnesses.proxy import ProxyLimits, ProxyServer

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")


async def _fuzz(engine, tokenizer, sessions: int, seed: int, concurrency: int = 8, max_turns: int = 5,
                max_new_tokens: int = 256, sdk: bool = True):
    policy = RecordingPolicy(engine)
    limits = ProxyLimits(max_new_tokens_per_turn=max_new_tokens)
    sem = asyncio.Semaphore(concurrency)
    async with ProxyServer(policy, tokenizer, limits=limits) as server, httpx.AsyncClient() as http:
        async def one(i: int):
            async with sem:
                session = server.open_session()
                # one connection pool for all clients: building an SSL context per client costs 0.1 s
                client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0,
                                            http_client=http) if sdk else RawClient(http, session.base_url,
                                                                                    session.api_key)
                record = await fuzz_session(client, random.Random(seed * 100_003 + i), max_turns, name=str(i))
                return session, record

        results = await asyncio.gather(*[one(i) for i in range(sessions)])
    checked = branched = 0
    for session, record in results:
        trajs = session.trajectories()
        assert len(trajs) == len(record.branches), (len(trajs), [b.sampled for b in record.branches])
        for traj, branch in zip(trajs, record.branches):
            check_branch(traj, branch.conversation, branch.sampled, record.tools, policy, tokenizer)
            checked += 1
        branched += len(trajs) > 1
    return checked, branched, results


def test_thousand_fuzzed_sessions_round_trip_token_exactly(tokenizer):
    """Over HTTP with responses validated as the openai SDK's types (~11 s of CPU for ~3,000 calls)."""
    checked, branched, results = asyncio.run(_fuzz(FuzzEngine(tokenizer), tokenizer, sessions=1000, seed=1,
                                                   sdk=False))
    assert checked >= 1000 and branched >= 50  # rewrites happened and each branch was checked
    turns = sum(s.turns for s, _ in results)
    parallel = sum(1 for _, r in results for b in r.branches for m in b.conversation
                   if len(m.get("tool_calls") or []) >= 2)
    assert turns >= 2500 and parallel >= 100


def test_openai_sdk_fuzzed_sessions_round_trip(tokenizer):
    """The official client as the agent: tools, parallel calls, stream=True with usage, n=1."""
    checked, _, results = asyncio.run(_fuzz(FuzzEngine(tokenizer), tokenizer, sessions=40, seed=2))
    assert checked >= 40 and sum(s.turns for s, _ in results) >= 100


def test_real_local_engine_sessions_round_trip(tokenizer, one_torch_thread):
    """20 sessions against the embedded engine with the tiny model: arbitrary sampled bytes, same contract."""
    import torch

    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen3")
    engine = EmbeddedEngine(model, tok, max_batch_size=8)

    async def main():
        try:
            return await _fuzz(engine, tok, sessions=20, seed=7, concurrency=8, max_turns=3, max_new_tokens=16)
        finally:
            await engine.shutdown()

    checked, _, results = asyncio.run(main())
    assert checked >= 20 and sum(s.turns for s, _ in results) >= 40


def test_history_rewrite_opens_a_second_valid_branch(tokenizer):
    """Dropping the model's thinking from its earlier turn (as Qwen3 templates and many agents do) cannot be
    an append to the token history: the proxy starts branch 1 from a fresh render; both are valid."""
    engine = RecordingPolicy(_Replies(tokenizer, ["<think>hmm</think>\nCall it. <tool_call>"
                                                  '{"name": "calc", "arguments": {"x": "1+1"}}</tool_call>',
                                                  "It is 2.", "Done."]))

    async def main():
        async with ProxyServer(engine, tokenizer) as server:
            s = server.open_session()
            client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
            tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
            msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "1+1?"}]
            r = await client.chat.completions.create(model="m", messages=msgs, tools=tools)
            m = r.choices[0].message
            assert m.content == "<think>hmm</think>\nCall it." and m.tool_calls[0].function.name == "calc"
            msgs.append(m.model_dump(exclude_none=True))
            msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "2"})
            await client.chat.completions.create(model="m", messages=msgs, tools=tools)
            assert len(s.trajectories()) == 1
            stripped = copy.deepcopy(msgs)
            stripped[2]["content"] = "Call it."  # thinking dropped from history
            await client.chat.completions.create(model="m", messages=stripped, tools=tools)
            return s.trajectories()

    first, second = asyncio.run(main())
    assert first.num_turns == 2 and second.num_turns == 1
    assert "message 2" in second.metadata["branch_reason"]
    text = tokenizer.decode(second.prompt_ids)
    assert "<think>" not in text and text.endswith("<|im_start|>assistant\n")
    for t in (first, second):
        t.reward = 0.0
        t.validate()


class _Replies:
    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, list(replies)

    async def generate(self, input_ids, sampling: SamplingParams, *, return_routed_experts=False):
        from miles_agent.engine import Completion, FinishReason

        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, [-0.25] * len(ids), FinishReason.STOP, 2, prompt_tokens=len(input_ids))


def test_moe_routing_is_recorded_for_every_token_of_a_branch(tokenizer, one_torch_thread):
    """R3: with return_routed_experts the trajectory carries the engine's routing, (len(tokens) - 1, L, k)."""
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    model, tok = build_tiny("tiny-qwen3-moe")
    policy = RecordingPolicy(EmbeddedEngine(model, tok, max_batch_size=2))

    async def main():
        limits = ProxyLimits(max_new_tokens_per_turn=6)
        async with ProxyServer(policy, tok, limits=limits, return_routed_experts=True) as server:
            s = server.open_session()
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) as c:
                msgs = [{"role": "user", "content": "hi"}]
                r = await c.chat.completions.create(model="m", messages=msgs)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "again"}]
                await c.chat.completions.create(model="m", messages=msgs)
        await policy.inner.shutdown()
        return s.trajectories()

    (traj,) = asyncio.run(main())
    traj.reward = 0.0
    traj.validate()
    last = policy.calls[tuple(traj.tokens[:len(traj.prompt_ids) + traj.spans[-1].start])]  # the 2nd call
    assert traj.routed_experts.shape[0] == len(traj.tokens) - 1 and traj.num_turns == 2
    assert (traj.routed_experts == last.routed_experts).all()
