"""Helpers shared by the engine tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio

import torch

from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    """Random byte-token prompts (ids < 256, no special tokens) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def run_all(engine: EmbeddedEngine, ps: list[list[int]], sampling: SamplingParams = GREEDY, **kw) -> list:
    """Serve ``ps`` concurrently in one event loop."""
    async def main():
        return await asyncio.gather(*[engine.generate(p, sampling, **kw) for p in ps])

    return asyncio.run(main())


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
