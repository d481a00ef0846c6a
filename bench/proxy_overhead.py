"""Benchmark: what the OpenAI-compatible proxy costs an episode, against calling the engine directly.

Workload: N concurrent chat episodes of T turns on the tiny model (EmbeddedEngine, tools in the prompt, a
tool-result message after every turn). The baseline does the TITO bookkeeping in-process -- render the
first prompt, then `ChatRenderer.observation_ids` per turn -- and calls ``engine.generate``; the proxy run
sends the same conversations through HTTP with the official ``openai`` client. Both sample at most
``new`` tokens per turn with the same stop tokens (the sampled-token totals are printed to show the engine
work matched); the figure is episodes per second, and the ratio is proxy / direct (1.0 = free).

    python bench/proxy_overhead.py            # 32 episodes x 3 turns, 32 new tokens
    python bench/proxy_overhead.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import torch
from openai import AsyncOpenAI

from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.harnesses.proxy import ProxyLimits, ProxyServer
from miles_agent.models.builder import build_tiny
from miles_agent.models.tokenizer import stop_token_ids
from miles_agent.tito import ChatRenderer

SAMPLED = {"direct": 0, "proxy": 0}
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


def opening(i: int) -> list[dict]:
    return [{"role": "system", "content": "Use calc."}, {"role": "user", "content": f"What is {i}*{i + 7}?"}]


async def direct(engine: EmbeddedEngine, tok, episodes: int, turns: int, new: int) -> None:
    stops = stop_token_ids(tok)  # what the proxy asks the engine to stop on
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=stops)

    async def one(i: int) -> None:
        renderer = ChatRenderer(tok, TOOLS)
        messages = opening(i)
        ids = renderer.prompt_ids(messages)
        for t in range(turns):
            c = await engine.generate(ids, sampling)
            SAMPLED["direct"] += len(c.output_ids)
            out = c.output_ids
            stopped = bool(out) and out[-1] in stops
            ids = ids + out
            messages.append({"role": "assistant", "content": tok.decode(out[:-1] if stopped else out)})
            obs = [{"role": "tool", "content": f"result {t}"}]
            ids = ids + renderer.observation_ids(messages, obs, tok.decode(out[-1:]) if stopped else "")
            messages += obs

    await asyncio.gather(*[one(i) for i in range(episodes)])


async def proxied(engine: EmbeddedEngine, tok, episodes: int, turns: int, new: int) -> None:
    limits = ProxyLimits(max_new_tokens_per_turn=new)
    async with ProxyServer(engine, tok, limits=limits, sampling=SamplingParams(temperature=1.0)) as server, \
            httpx.AsyncClient() as http:
        async def one(i: int) -> None:
            s = server.open_session()
            client = AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, http_client=http, max_retries=0)
            messages = opening(i)
            for t in range(turns):
                r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                SAMPLED["proxy"] += r.usage.completion_tokens
                messages.append(r.choices[0].message.model_dump(exclude_none=True))
                messages.append({"role": "tool", "content": f"result {t}"})
            assert s.turns == turns

        await asyncio.gather(*[one(i) for i in range(episodes)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.episodes, a.turns, a.new = 8, 2, 16
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok = build_tiny("tiny-qwen3")
    engine = EmbeddedEngine(model, tok, max_batch_size=64)

    async def run() -> dict[str, float]:
        await direct(engine, tok, 2, 1, 4)  # warm up both paths
        await proxied(engine, tok, 2, 1, 4)
        out = {}
        SAMPLED.update(direct=0, proxy=0)
        for name, fn in (("direct", direct), ("proxy", proxied)):
            t0 = time.perf_counter()
            await fn(engine, tok, a.episodes, a.turns, a.new)
            out[name] = a.episodes / (time.perf_counter() - t0)
        await engine.shutdown()
        return out

    r = asyncio.run(run())
    print(f"{a.episodes} episodes x {a.turns} turns x {a.new} new tokens (tiny-qwen3, EmbeddedEngine)")
    print(f"direct TITO harness : {r['direct']:.2f} episodes/s ({SAMPLED['direct']} tokens sampled)")
    print(f"proxy + openai SDK  : {r['proxy']:.2f} episodes/s ({SAMPLED['proxy']} tokens sampled)")
    print(f"ratio proxy/direct  : {r['proxy'] / r['direct']:.2f}")


if __name__ == "__main__":
    main()
