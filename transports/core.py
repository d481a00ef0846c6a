"""What every transport shares: the contract, size-bounded buckets, name maps, flat packing, checksums.

A flat bucket is SGLang's ``flattened_bucket`` layout: the bucket's tensors as raw bytes one after
another (no padding) in one uint8 tensor, plus (name, dtype, shape) per tensor in order. The receiver
allocates the same buffer from the announced names/dtypes/shapes and views it back into tensors, so
a bucket costs one send and one copy into the model on the engine side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from miles_agent.engine import PauseMode, RolloutEngine

if TYPE_CHECKING:  # pragma: no cover
    import torch

NameMap = Callable[[str], str]


class WeightSyncError(RuntimeError):
    """A transfer failed (engine gone, group broken, bad payload); the engine may hold mixed weights."""


class WeightMismatchError(WeightSyncError):
    """The check mode found engine weights that differ from what the trainer sent."""


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


def flat_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Like `buckets`, but also starts a new bucket where a tensor's byte offset would not be a multiple
    of its element size (mixed dtypes), since a flat bucket is viewed back per dtype without padding."""
    for bucket in buckets(named_tensors, bucket_bytes):
        part: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for name, t in bucket:
            if part and offset % t.element_size():
                yield part
                part, offset = [], 0
            part.append((name, t))
            offset += t.numel() * t.element_size()
        yield part


def prefix_map(strip: str = "", add: str = "") -> NameMap:
    """Trainer name -> engine name: remove ``strip`` where a name starts with it, then prepend ``add``."""
    def mapped(name: str) -> str:
        if strip and name.startswith(strip):
            name = name[len(strip):]
        return add + name
    return mapped


def identity(name: str) -> str:
    return name


# -- flat buckets ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorMeta:
    """One tensor's place in a flat bucket (the field names SGLang's ``FlattenedTensorMetadata`` uses)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    start_idx: int
    end_idx: int
    numel: int


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def bucket_metadata(names: list[str], dtypes: list[str], shapes: list[list[int]], flat: bool = True
                    ) -> list[TensorMeta]:
    """Byte ranges of each tensor in a flat bucket, from what the sender announced (``flat=False``: the
    tensors travel one by one, so a byte offset need not suit the dtype)."""
    import torch

    metas, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise WeightSyncError(f"tensor {name!r}: unknown dtype {dtype!r} (expected a torch dtype name "
                                  "such as 'float32' or 'bfloat16')")
        numel = 1
        for d in shape:
            numel *= int(d)
        size = numel * dt.itemsize
        if flat and offset % dt.itemsize:
            raise WeightSyncError(f"tensor {name!r} starts at byte {offset}, not a multiple of its "
                                  f"{dtype} element size; the sender must split buckets at dtype changes")
        metas.append(TensorMeta(name, tuple(int(d) for d in shape), dtype, offset, offset + size, size))
        offset += size
    return metas


def pack(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Copy a bucket's tensors into one flat uint8 tensor: the front of ``out`` when it is large enough
    (a reused staging or shared buffer), else a new tensor on ``out``'s device (or the tensors' own)."""
    import torch

    metas = bucket_metadata([n for n, _ in bucket], [dtype_name(t) for _, t in bucket],
                            [list(t.shape) for _, t in bucket])
    total = metas[-1].end_idx if metas else 0
    if out is not None and out.numel() >= total:
        flat = out[:total]
    else:
        device = out.device if out is not None else bucket[0][1].device if bucket else "cpu"
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), m in zip(bucket, metas):
        flat[m.start_idx:m.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, metas


def unpack(flat: torch.Tensor, metas: Iterable[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of a flat bucket as named tensors (no copy)."""
    import torch

    out = []
    for m in metas:
        dtype = getattr(torch, m.dtype) if isinstance(m.dtype, str) else m.dtype
        out.append((m.name, flat[m.start_idx:m.end_idx].view(dtype).reshape(m.shape)))
    return out


# -- host copies -------------------------------------------------------------------------------------

PARALLEL_COPY_MIN_BYTES = 1 << 20  # below this a copy stays on the calling thread: a hand-off costs more
_copy_pool: Any = None  # (the pid that made it, its ThreadPoolExecutor)


def usable_cores() -> int:
    """Cores this process may run on (all of them where the OS cannot say, e.g. macOS)."""
    import os

    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def copy_threads() -> int:
    """Threads for host-to-host weight copies: a core copies ~5 GB/s, well under memory bandwidth, and
    during a sync the trainer waits and the engine is paused, so their cores are free. At most 4."""
    return max(1, min(4, usable_cores()))


def copy_many_(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair. Contiguous host pairs of one dtype and shape (the weights of a sync)
    are cut into chunks and dealt to `copy_threads` threads in byte-balanced shares, one hand-off per thread
    per call (torch's copy releases the GIL); the rest are copied plainly."""
    import os

    import torch

    chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = 0
    for dst, src in pairs:
        if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape
                or not dst.is_contiguous() or not src.is_contiguous()):
            dst.copy_(src)
            continue
        d, s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for i in range(0, d.numel(), PARALLEL_COPY_MIN_BYTES):
            chunks.append((d[i:i + PARALLEL_COPY_MIN_BYTES], s[i:i + PARALLEL_COPY_MIN_BYTES]))
        total += d.numel()
    threads = min(copy_threads(), max(1, total // PARALLEL_COPY_MIN_BYTES))
    if threads == 1:
        for d, s in chunks:
            d.copy_(s)
        return
    shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(threads)]
    share_bytes = -(-total // threads)
    filled = 0
    for d, s in chunks:  # consecutive chunks per share: each thread streams through its own memory
        shares[min(filled // share_bytes, threads - 1)].append((d, s))
        filled += d.numel()
    global _copy_pool
    if _copy_pool is None or _copy_pool[0] != os.getpid():  # a forked child has the pool but not its threads
        from concurrent.futures import ThreadPoolExecutor

        _copy_pool = (os.getpid(), ThreadPoolExecutor(3, thread_name_prefix="weight-copy"))  # + the caller
    rest = [_copy_pool[1].submit(_copy_share, share) for share in shares[1:]]
    _copy_share(shares[0])
    for f in rest:
        f.result()


def _copy_share(share: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in share:
        d.copy_(s)


# -- check mode ---------------------------------------------------------------------------------------

def tensor_checksum(t: torch.Tensor) -> str:
    """First 8 bytes of the SHA-256 of the tensor's raw bytes, as 16 hex digits (SGLang's CPU checksum
    in ``/weights_checker``): equal iff the bytes are equal, whatever side computed it."""
    import torch

    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def module_checksums(model: torch.nn.Module) -> dict[str, str]:
    """Checksums of every parameter and buffer under every name it has (tied weights appear twice)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return {n: tensor_checksum(t) for n, t in named.items()}


def compare_checksums(expected: dict[str, str], actual: dict[str, str], *, engine: str, version: int) -> None:
    """Raise WeightMismatchError naming the first differing tensor (and how many differ) if any does."""
    missing = [n for n in expected if n not in actual]
    differ = [n for n in expected if n in actual and actual[n] != expected[n]]
    if not missing and not differ:
        return
    bad = differ + missing
    first = bad[0]
    what = (f"holds different values for {first!r} (engine checksum {actual[first]}, trainer {expected[first]})"
            if first in actual else f"has no tensor named {first!r}")
    raise WeightMismatchError(
        f"weight check failed after sync to version {version}: {engine} {what}; {len(bad)} of "
        f"{len(expected)} tensors differ ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}). "
        "The transfer or the engine-side load corrupted them: do not sample from this engine; "
        "retry the sync, or switch sync.transport to rule out the transport")


class InProcessTransport:
    """Trainer and engines in one process: pause, copy bucket by bucket, set the version, resume.

    Peak extra memory is one bucket (``bucket_bytes``) of gathered full tensors.
    """

    def __init__(self, engines: list[RolloutEngine], bucket_bytes: int = 64 << 20,
                 name_map: NameMap | None = None, pause_mode: PauseMode = PauseMode.IN_PLACE,
                 check: bool = False) -> None:
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.name_map = name_map or identity
        self.pause_mode = pause_mode
        self.check = check

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        for e in self.engines:
            await e.pause(self.pause_mode)
        total, n_buckets = 0, 0
        expected: dict[str, str] = {}
        try:
            for bucket in buckets(named_tensors, self.bucket_bytes):
                mapped = [(self.name_map(n), t.detach()) for n, t in bucket]
                if self.check:
                    expected.update((n, tensor_checksum(t)) for n, t in mapped)
                for e in self.engines:
                    await e.update_weights(mapped, version)
                total += sum(t.numel() * t.element_size() for _, t in mapped)
                n_buckets += 1
            for i, e in enumerate(self.engines if self.check else []):
                compare_checksums(expected, module_checksums(e.model), engine=f"engine {i} (in-process)",
                                  version=version)
        finally:
            for e in self.engines:
                await e.resume()
        return {"sync_bytes": float(total), "sync_buckets": float(n_buckets)}
