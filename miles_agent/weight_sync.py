"""Moving weights from the trainer to the rollout engines, versioned and bucketed.

``InProcessTransport`` is the embedded default: trainer and engine live in one process, so a bucket
is a list of tensors handed over by reference and copied into the engine's parameters. Peak extra
memory is one bucket (``bucket_bytes``) of gathered full tensors. Other transports (shared memory,
a torch.distributed group shaped like SGLang's ``update_weights_from_distributed``, safetensors on
disk) implement the same ``push``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from miles_agent.engine import PauseMode, RolloutEngine

if TYPE_CHECKING:  # pragma: no cover
    import torch

NameMap = Callable[[str], str]


class WeightTransport(Protocol):
    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Deliver a full set of weights as ``version``; returns metrics (bytes, buckets)."""
        ...


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class InProcessTransport:
    """Trainer and engines in one process: pause, copy bucket by bucket, set the version, resume."""

    def __init__(self, engines: list[RolloutEngine], bucket_bytes: int = 64 << 20,
                 name_map: NameMap | None = None, pause_mode: PauseMode = PauseMode.IN_PLACE) -> None:
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.name_map = name_map or (lambda n: n)
        self.pause_mode = pause_mode

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        for e in self.engines:
            await e.pause(self.pause_mode)
        total, n_buckets = 0, 0
        try:
            for bucket in buckets(named_tensors, self.bucket_bytes):
                mapped = [(self.name_map(n), t.detach()) for n, t in bucket]
                for e in self.engines:
                    await e.update_weights(mapped, version)
                total += sum(t.numel() * t.element_size() for _, t in mapped)
                n_buckets += 1
        finally:
            for e in self.engines:
                await e.resume()
        return {"sync_bytes": float(total), "sync_buckets": float(n_buckets)}
