"""The push skeleton the shm, distributed and disk transports share: pause every engine, map names, send
bucket by bucket (the part each transport defines), optionally verify checksums, resume.

Engines here are `WeightReceiver`s (SGLang's weight-update API). The check mode hashes every tensor on
the trainer side as it is read (before packing, so it sees the trainer's values, not the wire's) and
compares with the engine's own hashes of its loaded weights; any difference raises WeightMismatchError
naming the tensor.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from miles_agent.engine import PauseMode
from miles_agent.transports.core import (
    NameMap,
    WeightSyncError,
    compare_checksums,
    identity,
    tensor_checksum,
)
from miles_agent.transports.receiver import WeightReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch


class EngineTransport(ABC):
    """Base of the transports that drive `WeightReceiver` engines; subclasses implement ``_send``."""

    kind = "base"

    def __init__(self, engines: list[WeightReceiver], *, bucket_bytes: int = 64 << 20,
                 name_map: NameMap | None = None, check: bool = False,
                 pause_mode: PauseMode = PauseMode.IN_PLACE) -> None:
        if not engines:
            raise ValueError("a weight transport needs at least one engine")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.name_map = name_map or identity
        self.check = check
        self.pause_mode = PauseMode(pause_mode)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Pause the engines, send, (check,) continue them. The stats time each phase: ``sync_pause_s``,
        ``sync_send_s`` and ``sync_continue_s`` within ``sync_seconds`` (where a slow push spends its time)."""
        t0 = time.perf_counter()
        await self._each(lambda e: e.pause_generation(mode=str(self.pause_mode)))
        t_paused = time.perf_counter()
        expected: dict[str, str] | None = {} if self.check else None
        try:
            stats = await self._send(self._mapped(named_tensors, expected), version)
            stats["sync_send_s"] = time.perf_counter() - t_paused
            if expected is not None:
                await self.verify(expected, version)
        finally:
            t_continue = time.perf_counter()
            await self._each(lambda e: e.continue_generation())
        stats["sync_seconds"] = time.perf_counter() - t0
        stats["sync_pause_s"] = t_paused - t0
        stats["sync_continue_s"] = time.perf_counter() - t_continue
        if self.check:
            stats["sync_checked_tensors"] = float(len(expected or {}))
        return stats

    async def verify(self, expected: dict[str, str], version: int) -> None:
        """Compare the engines' checksums of their loaded weights with ``expected`` (engine names)."""
        replies = await self._each(lambda e: e.check_weights(action="checksum"))
        for i, reply in enumerate(replies):
            compare_checksums(expected, reply["checksums"], engine=f"engine {i} ({self.kind} transport)",
                              version=version)

    async def close(self) -> None:  # noqa: B027 - optional hook: most transports hold nothing
        """Release what the transport holds (groups, buffers); the engines stay up."""

    @abstractmethod
    async def _send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        ...

    def _mapped(self, named_tensors: Iterable[tuple[str, torch.Tensor]], expected: dict[str, str] | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors:
            mapped, t = self.name_map(name), t.detach()
            if expected is not None:
                expected[mapped] = tensor_checksum(t)
            yield mapped, t

    async def _each(self, call: Callable[[WeightReceiver], Awaitable[Any]]) -> list[Any]:
        """Run one request on every engine concurrently; the first failure is raised naming the engine."""
        results = await asyncio.gather(*(call(e) for e in self.engines), return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                cause = str(r) if isinstance(r, WeightSyncError) else f"{type(r).__name__}: {r}"
                raise WeightSyncError(f"engine {i} ({self.kind} transport): {cause}") from r
        return results
