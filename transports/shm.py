"""Colocated weight sync: buckets travel as serialized tensor handles, SGLang's ``update_weights_from_tensor``.

The trainer packs each bucket into one flat staging tensor and sends a handle to it; only the handle
crosses the process boundary, the engine views the shared bucket and copies it into its model.

- CPU: the staging buffer is a shared-memory file made once per transport, and a bucket's handle is
  (file path, byte count). The engine maps a segment once and keeps the mapping, so a bucket
  costs one pickle of a few hundred bytes. (torch's own CPU reduction would pass a file descriptor
  through a helper thread for every bucket: two extra process wake-ups each, which dominated the sync
  time on a loaded machine.)
- CUDA: the bucket is pickled with torch's multiprocessing reductions, which send a CUDA IPC handle, as
  SGLang's ``update_weights_from_tensor`` expects. Written but untested here (no GPU in CI): the stream
  is synchronized before the handle is sent; an engine on another device index would need SGLang-style
  device remapping, which this module does not do.

Extra memory: two buckets on the trainer side (double-buffered: it packs the next bucket while the
engines copy the last one; reused across pushes), none on the engine side.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pickle
import tempfile
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles_agent.transports.base import EngineTransport
from miles_agent.transports.core import flat_buckets, pack
from miles_agent.transports.receiver import WeightReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch


class SegmentUnavailable(OSError):
    """The shared-memory file could not be reserved (tmpfs full or too small)."""

    unwritten: Any = None  # what a writer was about to put there (runtime/shared_weights.py)


PREFIX = "miles-weights-"
STALE_AFTER_S = 60.0  # a file this old and unlocked lost its owner (a younger one may not be locked yet)


class SharedSegment:
    """A shared-memory file (in /dev/shm where it exists) mapped as a uint8 tensor; deleted on close.

    A file mapped with MAP_SHARED (``torch.from_file(shared=True)``) rather than Python's SharedMemory,
    whose resource tracker would also claim segments the engine attaches to.

    The owner holds a shared ``flock`` on its file while it lives; the kernel drops it when the process
    dies, however it dies. A killed trainer cannot delete its files (tmpfs pages stay taken until reboot),
    so each new segment first deletes the files of owners that are gone (`sweep_stale_segments`).
    """

    def __init__(self, nbytes: int) -> None:
        import fcntl

        import torch

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        sweep_stale_segments(folder or tempfile.gettempdir())
        fd, self.path = tempfile.mkstemp(prefix=PREFIX, dir=folder)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:  # reserve the pages now: a sparse file on a full tmpfs would kill the writer with SIGBUS later
            if hasattr(os, "posix_fallocate"):  # not on macOS (no /dev/shm there either: a temp file)
                os.posix_fallocate(fd, 0, max(1, nbytes))
        except OSError as e:
            os.close(fd)
            _unlink(self.path)
            raise SegmentUnavailable(f"cannot reserve {nbytes / 2**20:.0f} MiB of shared memory in "
                                     f"{folder or tempfile.gettempdir()} ({e.strerror}): give the machine (or "
                                     "container: --shm-size) more shared memory, or lower sync.bucket_mb") from e
        self.tensor = torch.from_file(self.path, shared=True, size=max(1, nbytes), dtype=torch.uint8)
        self._finalizer = weakref.finalize(self, _release, fd, self.path)

    def handle(self, nbytes: int) -> SegmentHandle:
        return SegmentHandle(self.path, nbytes)

    def close(self) -> None:
        self.tensor = None
        self._finalizer()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _release(fd: int, path: str) -> None:
    _unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)  # drops the lock


def sweep_stale_segments(folder: str) -> int:
    """Delete the segment files in ``folder`` whose owner is gone: no process holds their lock (and they are
    older than `STALE_AFTER_S`, so a file made but not locked yet is spared). Returns how many."""
    import time

    removed = 0
    with contextlib.suppress(OSError):
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
        for name in names:
            path = os.path.join(folder, name)
            try:
                if time.time() - os.stat(path).st_mtime < STALE_AFTER_S:
                    continue
            except OSError:  # gone meanwhile
                continue
            if segment_owner_alive(path) is False:
                _unlink(path)
                removed += 1
    return removed


def segment_owner_alive(path: str) -> bool | None:
    """Whether a process holds the lock of segment ``path`` (its owner lives); None when the file cannot be
    opened (gone, or another user's)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        return False
    finally:
        os.close(fd)  # drops the lock taken to test


class SegmentHandle:
    """Pickles to (segment path, byte count); unpickles, in the engine, to a tensor over that memory."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes

    def __reduce__(self) -> tuple:
        return attach_segment, (self.path, self.nbytes)


_ATTACHED: dict[str, torch.Tensor] = {}  # engine side: segment path -> mapped tensor


def attach_segment(path: str, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a trainer's segment as a uint8 tensor (zero-copy). The mapping is kept while
    the file exists: mapping again would fault every page in anew on each push. A trainer deletes the
    segments it replaces or closes, so mappings of deleted files are dropped when a new one is made."""
    import torch

    if path not in _ATTACHED:
        for old in [p for p in _ATTACHED if not os.path.exists(p)]:
            del _ATTACHED[old]
        size = os.path.getsize(path)
        _ATTACHED[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    return _ATTACHED[path][:nbytes]


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
        # Two staging buffers per device: the trainer packs bucket k+1 while the engines still read bucket k.
        self._segments: list[SharedSegment | None] = [None, None]
        self._cuda_staging: list[torch.Tensor | None] = [None, None]

    def _staging_for(self, device: torch.device, nbytes: int, slot: int) -> torch.Tensor:
        """Staging buffer ``slot`` of at least ``nbytes`` on ``device`` (grown when a tensor exceeds a bucket)."""
        import torch

        size = max(nbytes, self.bucket_bytes)
        if device.type == "cpu":
            seg = self._segments[slot]
            if seg is None or seg.tensor.numel() < nbytes:
                if seg is not None:
                    seg.close()
                seg = self._segments[slot] = SharedSegment(size)
            return seg.tensor
        if device.type == "cuda":
            buf = self._cuda_staging[slot]
            if buf is None or buf.device != device or buf.numel() < nbytes:
                buf = self._cuda_staging[slot] = torch.empty(size, dtype=torch.uint8, device=device)
            return buf
        raise ValueError(f"the shm transport moves CPU (shared memory) or CUDA (IPC) tensors, not {device}; "
                         "use sync.transport=disk or distributed")

    async def _send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        import torch

        total, n = 0, 0
        inflight: asyncio.Future | None = None  # the previous bucket's requests; its slot is the other one
        try:
            for bucket in flat_buckets(named_tensors, self.bucket_bytes):
                slot = n % 2
                nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
                flat, metas = pack(bucket, out=self._staging_for(bucket[0][1].device, nbytes, slot))
                if flat.is_cuda:  # the engine reads the IPC memory on its own stream
                    torch.cuda.current_stream(flat.device).synchronize()
                    payload = serialize({"flattened_tensor": flat, "metadata": metas})
                else:
                    seg = self._segments[slot]
                    assert seg is not None and flat.data_ptr() == seg.tensor.data_ptr()
                    payload = pickle.dumps({"flattened_tensor": seg.handle(flat.numel()), "metadata": metas})
                request = dict(serialized_named_tensors=[payload] * self.tp_size, load_format="flattened_bucket",
                               weight_version=str(version))
                if inflight is not None:
                    await inflight
                inflight = asyncio.ensure_future(
                    self._each(lambda e, request=request: e.update_weights_from_tensor(**request)))
                for _ in range(3):  # let the requests go out before packing the next bucket
                    await asyncio.sleep(0)
                total += flat.numel()
                n += 1
        finally:
            if inflight is not None:
                await inflight
        return {"sync_bytes": float(total), "sync_buckets": float(n)}

    async def close(self) -> None:
        for seg in self._segments:
            if seg is not None:
                seg.close()
        self._segments, self._cuda_staging = [None, None], [None, None]
