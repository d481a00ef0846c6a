"""An example black-box agent: the plain tool loop most agent programs are, written with the openai client.

It reads the task from ``$MILES_ENV_URL/task``, asks the model (``$OPENAI_BASE_URL``), runs every tool
call it gets through ``$MILES_ENV_URL/tools/call`` and sends the results back, until the model answers
without a tool call or the proxy says a limit was reached. It knows nothing about tokens or training.

    python -m miles_agent.harnesses.agents.openai_tool_loop      # as the black-box harness runs it
    env.agent=miles_agent.harnesses.agents.openai_tool_loop:agent  # the same loop, in-process
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

LIMIT_CODES = ("turn_limit_reached", "context_length_exceeded")


async def solve(base_url: str, api_key: str, env_url: str, *, max_turns: int = 32,
                stream: bool = False) -> list[dict[str, Any]]:
    """Play one episode; returns the conversation as the agent kept it."""
    import httpx
    from openai import AsyncOpenAI, BadRequestError

    headers = {"Authorization": f"Bearer {api_key}"}
    # One HTTP client for the model and the tools. Over plain http there is no TLS to verify, and loading
    # the CA bundle costs ~0.1 s of CPU per client -- a tax on every short episode.
    plain = base_url.startswith("http://") and env_url.startswith("http://")
    async with httpx.AsyncClient(headers=headers, timeout=120, verify=not plain) as env, \
            AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=env) as client:
        task = (await env.get(f"{env_url}/task")).raise_for_status().json()
        messages, tools = list(task["messages"]), task["tools"]
        for _ in range(max_turns):
            try:
                message = await _ask(client, messages, tools, stream)
            except BadRequestError as e:
                if e.code in LIMIT_CODES:
                    break  # the episode's budget is spent: stop, the verifier scores what there is
                raise
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                fn = call["function"]
                reply = await env.post(f"{env_url}/tools/call", json={"name": fn["name"], "arguments": fn["arguments"]})
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": reply.raise_for_status().json()["content"]})
    return messages


async def _ask(client: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], stream: bool) -> dict:
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    if not stream:
        reply = await client.chat.completions.create(model="policy", messages=messages, **kwargs)
        return reply.choices[0].message.model_dump(exclude_none=True)
    content, calls = [], {}
    async for chunk in await client.chat.completions.create(model="policy", messages=messages, stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        for tc in (delta.tool_calls or []) if delta else []:
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.id or slot["id"]
            if tc.function:
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
        if delta and delta.content:
            content.append(delta.content)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


async def agent(ctx: Any) -> None:
    """The in-process form (env.agent=module:function): same loop, given an AgentContext."""
    await solve(ctx.base_url, ctx.api_key, ctx.env_url)


def main() -> None:
    asyncio.run(solve(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["MILES_ENV_URL"],
                      stream=os.environ.get("AGENT_STREAM") == "1"))


if __name__ == "__main__":
    main()
