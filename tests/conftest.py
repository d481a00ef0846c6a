"""Shared fixtures: the offline tokenizer and a scripted policy that speaks the Policy contract."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray reads its loopback switch when first imported, and any test module may import it first (a helper that
# imports ray inside a function): set it before all of them, so every Ray this suite starts binds 127.0.0.1.
from miles_agent.runtime.ray_cluster import loopback_only  # noqa: E402

loopback_only()


@pytest.fixture(autouse=True)
def _restore_excepthook():
    """torch's init_process_group wraps sys.excepthook (a "[rankN]:" prefix) and never unwraps it. One
    training process inits once; this suite inits hundreds of groups in one process, and the nested
    hooks grew deep enough to crash pytest's report of an unrelated failure. Each test starts afresh."""
    hook = sys.excepthook
    yield
    sys.excepthook = hook


@pytest.fixture(scope="session")
def tokenizer():
    from miles_agent.models.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


class ScriptedPolicy:
    """Replies with fixed texts in order (each followed by EOS), logprob -0.5 per token."""

    def __init__(self, tokenizer, replies: list[str], eos: bool = True, version: int = 3) -> None:
        self.tokenizer, self.replies, self.eos, self.version = tokenizer, list(replies), eos, version
        self.calls: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        from miles_agent.engine import Completion, FinishReason

        self.calls.append(list(input_ids))
        text = self.replies.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        finish = FinishReason.LENGTH
        if self.eos:
            ids, finish = ids + [self.tokenizer.eos_token_id], FinishReason.STOP
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], FinishReason.LENGTH
        self.sampled.append(ids)
        return Completion(ids, [-0.5] * len(ids), finish, self.version, prompt_tokens=len(input_ids))


@pytest.fixture
def scripted(tokenizer):
    return lambda replies, **kw: ScriptedPolicy(tokenizer, replies, **kw)
