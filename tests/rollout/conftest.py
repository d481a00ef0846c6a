"""Fixtures for the embedded-engine tests: tiny fp32 models (built once) and engines over copies of them."""

from __future__ import annotations

import copy

import pytest

from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny


@pytest.fixture(scope="session")
def tiny_models():
    """arch -> (model, tokenizer); the engine always gets a deep copy, so these stay the HF reference."""
    return {arch: build_tiny(arch) for arch in ("tiny-qwen3", "tiny-qwen3-moe")}


@pytest.fixture
def make_engine(tiny_models):
    def make(arch: str = "tiny-qwen3", **kw) -> EmbeddedEngine:
        model, tok = tiny_models[arch]
        return EmbeddedEngine(copy.deepcopy(model), tok, **kw)

    return make


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on shared cores OpenMP barriers made HF
    ``generate`` (the reference) 5-15x slower from run to run; restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
