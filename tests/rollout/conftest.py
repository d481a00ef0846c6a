"""Fixtures for the embedded-engine tests: tiny fp32 models (built once) and engines over copies of them."""

from __future__ import annotations

import copy

import pytest

from miles_agent.models.builder import build_tiny
from miles_agent.rollout.local import LocalEngine


@pytest.fixture(scope="session")
def tiny_models():
    """arch -> (model, tokenizer); the engine always gets a deep copy, so these stay the HF reference."""
    return {arch: build_tiny(arch) for arch in ("tiny-qwen3", "tiny-qwen3-moe")}


@pytest.fixture
def make_engine(tiny_models):
    def make(arch: str = "tiny-qwen3", **kw) -> LocalEngine:
        model, tok = tiny_models[arch]
        return LocalEngine(copy.deepcopy(model), tok, **kw)

    return make
