"""Colocated weight sync: buckets travel as serialized tensor handles, SGLang's ``update_weights_from_tensor``.

The trainer packs each bucket into one flat tensor and pickles it with torch's multiprocessing
reductions, which turn a CPU tensor into a shared-memory handle (a file descriptor the engine process
maps) and a CUDA tensor into a CUDA IPC handle. Only the handle crosses the process boundary; the engine
views the shared bucket and copies it into its model. Extra memory: one bucket on the trainer side
(a shared staging buffer reused across buckets and pushes), none beyond the model on the engine side.

The CUDA IPC path is written but untested here (no GPU in CI): the bucket is packed on the trainer's
GPU and the stream synchronized before its handle is sent; an engine on another device index needs
SGLang-style device remapping, which this module does not do.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles_agent.weight_sync.base import EngineTransport
from miles_agent.weight_sync.core import flat_buckets, pack
from miles_agent.weight_sync.receiver import WeightReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch


def serialize(obj: Any) -> bytes:
    """Pickle with torch's reductions: tensors become shared-memory / CUDA IPC handles, not bytes."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


class SharedMemoryTransport(EngineTransport):
    """Colocated engines: shared memory on CPU, CUDA IPC on GPU, one handle per bucket."""

    kind = "shm"

    def __init__(self, engines: list[WeightReceiver], *, tp_size: int = 1, **kwargs: Any) -> None:
        super().__init__(engines, **kwargs)
        self.tp_size = tp_size  # SGLang takes one serialized payload per tensor-parallel rank
        self._staging: torch.Tensor | None = None

    def _staging_for(self, device: torch.device) -> torch.Tensor:
        import torch

        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the shm transport moves CPU (shared memory) or CUDA (IPC) tensors, not {device}; "
                             "use sync.transport=disk or distributed")
        if self._staging is None or self._staging.device != device:
            staging = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
            self._staging = staging.share_memory_() if device.type == "cpu" else staging
        return self._staging

    async def _send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        import torch

        total, n = 0, 0
        for bucket in flat_buckets(named_tensors, self.bucket_bytes):
            flat, metas = pack(bucket, out=self._staging_for(bucket[0][1].device))
            if flat.is_cuda:  # the engine reads the IPC memory on its own stream
                torch.cuda.current_stream(flat.device).synchronize()
            payload = serialize({"flattened_tensor": flat, "metadata": metas})
            request = dict(serialized_named_tensors=[payload] * self.tp_size, load_format="flattened_bucket",
                           weight_version=str(version))
            await self._each(lambda e, request=request: e.update_weights_from_tensor(**request))
            total += flat.numel()
            n += 1
        return {"sync_bytes": float(total), "sync_buckets": float(n)}

    async def close(self) -> None:
        self._staging = None
