"""The weight-transport contract (``WeightTransport.push``): weights a trainer pushes arrive bit-exact,
under the version it named, push after push.

Provide ``make_transport``: a callable ``() -> (transport, probe)`` for a transport delivering to one
``tiny-qwen3`` engine; ``probe`` reads the engine side: ``await probe.version()`` and
``await probe.checksums()`` (name -> ``weight_sync.core.tensor_checksum``). `ReceiverProbe` wraps anything
with SGLang's ``check_weights`` and a ``weight_version`` (property or coroutine): ``InProcessReceiver``,
``EngineProcess``, ``SGLangEngine``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from miles_agent.testing.contracts._fixtures import fixture_missing
from miles_agent.transports.core import tensor_checksum


class ReceiverProbe:
    def __init__(self, receiver: Any) -> None:
        self.receiver = receiver

    async def version(self) -> int:
        v = self.receiver.weight_version
        v = v() if callable(v) else v
        return int(await v if inspect.isawaitable(v) else v)

    async def checksums(self) -> dict[str, str]:
        return dict((await self.receiver.check_weights())["checksums"])


def seeded_weights(seed: int, arch: str = "tiny-qwen3") -> list[tuple[str, torch.Tensor]]:
    """A tiny model's state dict where every tensor is specific to ``seed`` (the tiny init leaves norms at
    constants, which a transfer that moved nothing would still match)."""
    from miles_agent.models.builder import build_tiny

    model, _ = build_tiny(arch, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    return list(model.state_dict().items())


class WeightTransportContract:
    @pytest.fixture
    def make_transport(self) -> Callable[[], tuple[Any, Any]]:
        fixture_missing("WeightTransportContract", "make_transport", "a callable returning (transport, ReceiverProbe of its engine)")

    async def check_arrived(self, probe: Any, pushed: list[tuple[str, torch.Tensor]], version: int) -> None:
        got_version, sums = await probe.version(), await probe.checksums()
        assert got_version == version, f"the engine reports weight version {got_version} after pushing {version}"
        missing = [n for n, _ in pushed if n not in sums]
        assert not missing, f"the engine has no {missing[:3]}"
        differ = [n for n, t in pushed if sums[n] != tensor_checksum(t)]
        assert not differ, f"{len(differ)} tensors did not arrive bit-exact, first {differ[0]!r}"

    def test_pushed_weights_arrive_bit_exact_with_the_version(self, make_transport) -> None:
        async def run() -> None:
            transport, probe = make_transport()
            pushed = seeded_weights(21)
            metrics = await transport.push(iter(pushed), version=7)
            assert isinstance(metrics, dict), f"push returns its metrics, got {metrics!r}"
            await self.check_arrived(probe, pushed, 7)

        asyncio.run(run())

    def test_a_second_push_replaces_the_first(self, make_transport) -> None:
        async def run() -> None:
            transport, probe = make_transport()
            first, second = seeded_weights(22), seeded_weights(23)
            await transport.push(iter(first), version=1)
            await transport.push(iter(second), version=2)
            await self.check_arrived(probe, second, 2)

        asyncio.run(run())
