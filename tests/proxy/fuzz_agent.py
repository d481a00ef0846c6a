"""A randomized OpenAI-client agent for the round-trip tests: tools, system prompts, unicode, parallel tool
calls, streaming, resent messages in different JSON spellings, and history rewrites that must branch.

It tracks, for each branch it expects the proxy to open, the conversation and which assistant messages
were sampled on that branch, so the oracle in proxy_helpers can check every trajectory.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from proxy_helpers import TOOL_NAMES, UNICODE, tool_schema


@dataclass
class BranchRecord:
    conversation: list[dict[str, Any]]
    sampled: list[int] = field(default_factory=list)


@dataclass
class SessionRecord:
    tools: list[dict[str, Any]] | None
    branches: list[BranchRecord] = field(default_factory=list)


async def fuzz_session(client: Any, rng: random.Random, max_turns: int = 5, name: str = "") -> SessionRecord:
    """``name`` makes the opening unique, so no two sessions ever send the engine the same input ids."""
    tools = [tool_schema(n) for n in rng.sample(TOOL_NAMES, rng.randint(0, 3))] or None
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": rng.choice(["system", "system", "developer"]),
                         "content": f"You are helpful. {rng.choice(UNICODE)}"})
    messages.append({"role": "user", "content": f"task {name}: {rng.choice(UNICODE)}"})
    record = SessionRecord(tools)
    branch = BranchRecord([])
    record.branches.append(branch)
    rewrites = 0
    for turn in range(rng.randint(1, max_turns)):
        if turn and rng.random() < 0.12:  # the agent rewrites its history: a new branch must start
            rewrites += 1
            messages = _rewrite(messages, rng, rewrites)
            branch = BranchRecord([])
            record.branches.append(branch)
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        if rng.random() < 0.3:
            kwargs["max_tokens"] = rng.choice([8, 40, 200])
        message = await _ask(client, messages, kwargs, stream=rng.random() < 0.35)
        messages.append(_resend_form(message, rng))
        branch.sampled.append(len(messages) - 1)
        branch.conversation = [_normal(m) for m in messages]
        calls = message.get("tool_calls") or []
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"{call['function']['name']} -> {rng.choice(UNICODE)}"})
        if not calls:
            text = rng.choice(UNICODE) + " more?"
            parts = [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]
            messages.append({"role": "user", "content": parts if rng.random() < 0.2 else text})
    return record


class RawClient:
    """The same calls as ``AsyncOpenAI.chat.completions.create`` over plain httpx, each response validated
    as the openai SDK's types. The SDK spends ~15 ms per call transforming its arguments; this keeps the
    1,000-session fuzz on the proxy's cost (the SDK itself drives the smaller runs)."""

    def __init__(self, http: Any, base_url: str, api_key: str) -> None:
        self.http, self.url, self.headers = http, base_url + "/chat/completions", {"Authorization": f"Bearer {api_key}"}

    async def create(self, **body: Any) -> Any:
        from openai.types.chat import ChatCompletion, ChatCompletionChunk

        if not body.get("stream"):
            r = await self.http.post(self.url, json=body, headers=self.headers)
            r.raise_for_status()
            return ChatCompletion.model_validate(r.json())

        async def chunks():
            async with self.http.stream("POST", self.url, json=body, headers=self.headers) as r:
                r.raise_for_status()
                assert r.headers["content-type"].startswith("text/event-stream")
                done = False
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    assert line.startswith("data: ") and not done, line
                    if line == "data: [DONE]":
                        done = True
                        continue
                    yield ChatCompletionChunk.model_validate(json.loads(line[len("data: "):]))
                assert done, "the stream did not end with [DONE]"
        return chunks()


async def _ask(client: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], stream: bool) -> dict[str, Any]:
    create = client.create if isinstance(client, RawClient) else client.chat.completions.create
    if not stream:
        r = await create(model="policy", messages=messages, n=1, **kwargs)
        return r.choices[0].message.model_dump(exclude_none=True)
    content, calls, finish = [], {}, None
    stream_obj = await create(model="policy", messages=messages, stream=True,
                              stream_options={"include_usage": True}, **kwargs)
    async for chunk in stream_obj:
        if not chunk.choices:
            assert chunk.usage is not None and chunk.usage.completion_tokens > 0
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.id or slot["id"]
            slot["function"]["name"] += (tc.function.name or "") if tc.function else ""
            slot["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert finish in ("stop", "length", "tool_calls")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _resend_form(message: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Agents resend the assistant turn in many spellings: the proxy must still see the same turn."""
    out = {"role": "assistant", "content": message.get("content")}
    if out["content"] is None and rng.random() < 0.5:
        out["content"] = ""
    if message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            args = c["function"]["arguments"]
            if rng.random() < 0.5:  # same JSON, other spacing and escaping
                args = json.dumps(json.loads(args), separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
            calls.append({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                           "arguments": args}})
        out["tool_calls"] = calls
    return out


def _rewrite(messages: list[dict[str, Any]], rng: random.Random, n: int) -> list[dict[str, Any]]:
    head = [m for m in messages[:2] if m["role"] in ("system", "developer", "user")]
    if rng.random() < 0.5:  # summarize the history
        return head + [{"role": "user", "content": f"summary #{n} of what happened: {rng.choice(UNICODE)}"}]
    edited = [dict(m) for m in messages]  # edit the last assistant turn (e.g. drop its thinking)
    last = max(i for i, m in enumerate(edited) if m["role"] == "assistant")
    edited[last]["content"] = f"[edited #{n}] " + (edited[last].get("content") or "")
    return edited


def _normal(m: dict[str, Any]) -> dict[str, Any]:
    """The message as the proxy normalizes it (the oracle renders what the proxy rendered)."""
    out = dict(m)
    if out["role"] == "developer":
        out["role"] = "system"
    if isinstance(out.get("content"), list):
        out["content"] = "".join(p["text"] for p in out["content"])
    return out
