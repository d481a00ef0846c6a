"""The rollout-engine contract (miles_agent.testing.contracts) against the SGLang client talking to the
fake SGLang server (SGLang's wire protocol over HTTP, backed by the embedded engine)."""

from __future__ import annotations

import asyncio

import pytest

from miles_agent.engines.sglang.client import SGLangEngine
from miles_agent.testing.contracts import EngineContract


@pytest.fixture(scope="module")
def contract_server(start_fake):
    """A server of its own: the contract pushes weights, which other tests' servers must not see."""
    return start_fake("tiny-qwen3")


class TestSGLangEngine(EngineContract):
    @pytest.fixture
    def engine(self, contract_server):
        client = SGLangEngine(contract_server.url)
        yield client
        asyncio.run(client.shutdown())

    @pytest.mark.xfail(strict=True, reason="found by the contract: SGLangEngine.update_weights sends torch "
                       "multiprocessing handles of CPU tensors, which only a child process of this one can "
                       "open (AuthenticationError from the server); the weight transports work (shm, disk, "
                       "distributed: tests/sglang/test_sglang_weights.py)")
    def test_update_weights_bumps_the_weight_version(self, engine, engine_weights) -> None:
        super().test_update_weights_bumps_the_weight_version(engine, engine_weights)
