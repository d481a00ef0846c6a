"""The rollout-engine contract (``miles_agent.engine.RolloutEngine``): what harnesses, the scheduler and
weight sync rely on.

Provide ``engine``: a started engine serving a model whose vocabulary covers ids below 100 and which
accepts ``update_weights`` with ``engine_weights`` (default: the ``tiny-qwen3`` state dict, seed 1).
The suite leaves the engine running; the fixture's owner shuts it down.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from miles_agent.engine import Completion, FinishReason, RolloutEngine, SamplingParams
from miles_agent.testing.contracts._fixtures import fixture_missing

PROMPT = [12, 40, 41, 42, 7, 19]


def generate(engine: RolloutEngine, sampling: SamplingParams, prompt: list[int] = PROMPT) -> Completion:
    return asyncio.run(engine.generate(list(prompt), sampling))


class EngineContract:
    @pytest.fixture
    def engine(self) -> RolloutEngine:
        fixture_missing("EngineContract", "engine", "a rollout engine to generate with")

    @pytest.fixture
    def engine_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        from miles_agent.models.builder import build_tiny

        return list(build_tiny("tiny-qwen3", seed=1)[0].state_dict().items())

    def test_generate_returns_ids_and_logprobs_of_equal_length(self, engine) -> None:
        out = generate(engine, SamplingParams(max_new_tokens=8, seed=3))
        assert out.output_ids, "no token generated"
        assert len(out.output_ids) == len(out.output_logprobs), \
            f"{len(out.output_ids)} ids but {len(out.output_logprobs)} logprobs"
        assert all(isinstance(t, int) for t in out.output_ids), "output ids must be ints"
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in out.output_logprobs), \
            f"logprobs must be finite and <= 0: {out.output_logprobs}"
        assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), out.finish_reason
        assert isinstance(out.weight_version, int)

    @pytest.mark.parametrize("n", [1, 5])
    def test_honours_max_new_tokens(self, engine, n: int) -> None:
        out = generate(engine, SamplingParams(max_new_tokens=n, temperature=0.0))
        assert len(out.output_ids) <= n, f"asked for at most {n} tokens, got {len(out.output_ids)}"
        if out.finish_reason is FinishReason.LENGTH:
            assert len(out.output_ids) == n, f"finish_reason=length after {len(out.output_ids)} of {n} tokens"

    def test_stops_at_a_stop_token_and_keeps_it(self, engine) -> None:
        free = generate(engine, SamplingParams(max_new_tokens=10, temperature=0.0))
        if len(free.output_ids) < 4:
            pytest.skip("the model stopped too early to pick a stop token from its own output")
        stop = free.output_ids[3]
        expected = free.output_ids[:free.output_ids.index(stop) + 1]
        out = generate(engine, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,)))
        assert out.output_ids == expected, f"stop token {stop}: expected {expected}, got {out.output_ids}"
        assert out.finish_reason is FinishReason.STOP, out.finish_reason

    def test_update_weights_bumps_the_weight_version(self, engine, engine_weights) -> None:
        version = engine.weight_version + 1
        asyncio.run(engine.update_weights(engine_weights, version))
        assert engine.weight_version == version, f"weight_version {engine.weight_version} after pushing {version}"
        out = generate(engine, SamplingParams(max_new_tokens=2))
        assert out.weight_version == version, f"a completion after the update reports {out.weight_version}"

    def test_pause_resume_and_health(self, engine) -> None:
        async def run() -> Any:
            assert await engine.health(), "a started engine reports healthy"
            await engine.pause()
            await engine.resume()
            return await engine.generate(list(PROMPT), SamplingParams(max_new_tokens=2))

        out = asyncio.run(run())
        assert out.finish_reason is not FinishReason.ABORT and out.output_ids, "no generation after resume"
