"""The rollout-engine contract against the embedded engine, and against engines broken on purpose
(the SGLang client runs it against the fake server in tests/sglang/test_sglang_contract.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny
from miles_agent.testing.contracts import EngineContract


@pytest.fixture
def local_engine():
    model, tok = build_tiny("tiny-qwen3", seed=0)
    engine = EmbeddedEngine(model, tok)
    yield engine
    asyncio.run(engine.shutdown())


class TestEmbeddedEngine(EngineContract):
    @pytest.fixture
    def engine(self, local_engine):
        return local_engine


class Wrapped:
    """Forwards everything to a real engine; subclasses break one thing."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, input_ids, sampling, **kw):
        return await self.inner.generate(input_ids, sampling, **kw)


class DropsALogprob(Wrapped):
    async def generate(self, input_ids, sampling, **kw):
        out = await self.inner.generate(input_ids, sampling, **kw)
        return dataclasses.replace(out, output_logprobs=out.output_logprobs[:-1])


class IgnoresMaxNewTokens(Wrapped):
    async def generate(self, input_ids, sampling, **kw):
        return await self.inner.generate(input_ids, dataclasses.replace(sampling, max_new_tokens=8), **kw)


class IgnoresStopTokens(Wrapped):
    async def generate(self, input_ids, sampling, **kw):
        return await self.inner.generate(input_ids, dataclasses.replace(sampling, stop_token_ids=()), **kw)


class ForgetsTheVersion(Wrapped):
    async def update_weights(self, named_tensors, version):
        await self.inner.update_weights(named_tensors, self.inner.weight_version)


def test_broken_engines_fail_the_contract(local_engine):
    contract = EngineContract()
    weights = list(build_tiny("tiny-qwen3", seed=1)[0].state_dict().items())
    with pytest.raises(AssertionError, match="logprobs"):
        contract.test_generate_returns_ids_and_logprobs_of_equal_length(DropsALogprob(local_engine))
    with pytest.raises(AssertionError, match="at most 5 tokens"):
        contract.test_honours_max_new_tokens(IgnoresMaxNewTokens(local_engine), 5)
    with pytest.raises(AssertionError, match="stop token"):
        contract.test_stops_at_a_stop_token_and_keeps_it(IgnoresStopTokens(local_engine))
    with pytest.raises(AssertionError, match="weight_version"):
        contract.test_update_weights_bumps_the_weight_version(ForgetsTheVersion(local_engine), weights)


def test_the_contract_prompt_generates_on_the_tiny_model(local_engine):
    out = asyncio.run(local_engine.generate([12, 40], SamplingParams(max_new_tokens=3, temperature=0.0)))
    assert len(out.output_ids) == 3
