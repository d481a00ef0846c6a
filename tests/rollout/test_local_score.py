"""The engine's scoring call (the `Scorer` contract): teacher-forced logprobs equal an HF forward."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import GREEDY, prompts, run_all

from miles_agent.engine import Scorer


def hf_logprobs(model, ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[start - 1:].tolist()


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("start,temperature", [(1, 1.0), (17, 1.0), (30, 0.7)])
def test_score_equals_a_direct_hf_forward(make_engine, tiny_models, arch, start, temperature):
    engine = make_engine(arch)
    assert isinstance(engine, Scorer)
    (ids,) = prompts(40, seed=3)
    out = asyncio.run(engine.score(ids, logprob_start_len=start, temperature=temperature))
    want = hf_logprobs(tiny_models[arch][0], ids, start, temperature)
    assert out.logprob_start_len == start and out.weight_version == 0
    assert len(out.input_token_logprobs) == len(ids) - start
    assert out.input_token_logprobs == pytest.approx(want, abs=2e-5)


def test_score_between_decode_steps_leaves_generation_unchanged(make_engine):
    ps = prompts(9, 23, 14, seed=5)
    alone = [c.output_ids for c in run_all(make_engine(), ps)]
    engine = make_engine()

    async def both():
        gens = [engine.generate(p, GREEDY) for p in ps]
        scores = [engine.score(p + [1, 2, 3], logprob_start_len=len(p)) for p in ps]
        return await asyncio.gather(*gens, *scores)

    results = asyncio.run(both())
    assert [c.output_ids for c in results[:3]] == alone
    solo = [asyncio.run(make_engine().score(p + [1, 2, 3], logprob_start_len=len(p))) for p in ps]
    assert [s.input_token_logprobs for s in results[3:]] == [s.input_token_logprobs for s in solo]


def test_score_waits_while_paused(make_engine):
    engine = make_engine()
    (ids,) = prompts(12)

    async def main():
        await engine.pause()
        task = asyncio.create_task(engine.score(ids))
        await asyncio.sleep(0.1)
        assert not task.done()  # weights may be mid-update while paused
        await engine.resume()
        return await task

    assert len(asyncio.run(main()).input_token_logprobs) == 11


def test_bad_score_requests_name_the_problem(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="logprob_start_len must be in"):
        asyncio.run(engine.score([1, 2, 3], logprob_start_len=0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(engine.score([1, 10**6]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        asyncio.run(engine.score([1, 2], temperature=0))
