"""The object-store push for engines on trainer rank 0's own node: the bytes go through shared memory that
rank 0 keeps from push to push, and only a handle of a few hundred bytes goes through Ray.

Why not ``ray.put``: a put copies each array into store pages that the putting process may never have
touched (about 4x slower when it lands there, at random), and Ray's put starts six copy threads for every
array of 1 MiB or more (~10 ms per push of ~30 such tensors on two cores). A segment that lives as long as
the trainer has its pages in place after the first push, and each tensor is one plain copy in, one copy
out -- the floor of any copy between two processes. This is the CPU form of what colocated RL stacks do
on GPUs (SGLang's ``update_weights_from_tensor`` with CUDA IPC handles).

Layout: shared-memory files (transports/shm.py) -- after the first push, one of exactly the model's size --
each starting with a 64-byte header: two int64s, the segment's generation and its written mark. Rank 0
bumps the generation of every segment before it overwrites any of them, so an engine that reads a handle
from an earlier push (a restart after a failed push) finds out instead of loading a mix of two versions.
The segments hold the last push whole: a restarted engine loads it from there (the supervisor keeps the
handles, as it kept object refs).

Announced pushes: once the layout has settled (one segment, the same tensors as the last push), rank 0 sends
each engine its handle before writing (`SharedWeightsWriter.announce`), so the call crosses Ray and the
engine pauses while the bytes are copied. The engine then waits for the written mark to reach the handle's
generation (`WrittenWaiter`; rank 0 wakes it through a datagram, `wake_engines`). A push laid out otherwise
after all (another model) or abandoned part way marks minus its generation: the engine loads nothing from
that call, and rank 0 sends the real handles.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_agent.transports.core import TensorMeta, WeightSyncError, copy_many_, dtype_name, unpack

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from miles_agent.transports.shm import SharedSegment

HEADER_BYTES = 64  # the generation, the written mark, then padding: every tensor starts 64-byte aligned
ALIGN = 64
# The first push's segments are at least this (more for a larger tensor): it cannot know the total before it
# has gathered every tensor. The second push moves into one segment of the exact size.
SEGMENT_BYTES = 64 << 20


@dataclass(frozen=True)
class SharedWeights:
    """One bucket of a push, in one segment: what crosses Ray instead of the bytes. ``tensors()`` on the
    engine's side maps the segment (once per process) and views the tensors in it."""

    path: str
    generation: int
    metas: tuple[TensorMeta, ...]  # byte ranges within the segment

    @property
    def nbytes(self) -> int:
        return sum(m.end_idx - m.start_idx for m in self.metas)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Named views into the segment (no copy): load them (copy them into parameters), then `check` that
        the trainer did not overwrite them meanwhile."""
        views = self.views()
        self.check()
        return views

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """`tensors` without the check that they are this handle's generation (an announced push's, before
        the bytes are written)."""
        return unpack(self._mapped(max(m.end_idx for m in self.metas)), self.metas)

    def header(self) -> torch.Tensor:
        """The segment's header (its generation and written mark), mapped."""
        return self._mapped(HEADER_BYTES)

    def check(self) -> None:
        """Raise if the trainer has started another push into this segment (call it after loading)."""
        now = int(_generation(self.header()).item())
        if now != self.generation:
            raise WeightSyncError(
                f"the weights in {self.path} were overwritten by a later push (generation {now}, this handle's "
                f"{self.generation}): a push failed part way and left its predecessor's handles; push again")

    def _mapped(self, nbytes: int) -> torch.Tensor:
        from miles_agent.transports.shm import attach_segment

        try:
            return attach_segment(self.path, nbytes)
        except (FileNotFoundError, RuntimeError) as e:
            raise WeightSyncError(
                f"the trainer's weight segment {self.path} cannot be mapped here ({e}): the engine is on another "
                "node than trainer rank 0, or the trainer has closed. Set sync.shared_memory=false to push "
                "through Ray's object store") from None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _generation(segment: torch.Tensor) -> torch.Tensor:
    import torch

    return segment[:8].view(torch.int64)


def _written(segment: torch.Tensor) -> torch.Tensor:
    """The generation whose bytes are all in place; minus it: that push will not match its announced handle."""
    import torch

    return segment[8:16].view(torch.int64)


class SharedWeightsWriter:
    """Trainer rank 0's side: the segments, reused by every push, and the copy of each push into them."""

    def __init__(self, min_segment_bytes: int = SEGMENT_BYTES) -> None:
        self.min_segment_bytes = min_segment_bytes
        self.segments: list[SharedSegment] = []
        self.generation = 0
        self.needed = 0  # the last whole push's bytes, as laid out (0: none yet)
        self.layout: tuple[TensorMeta, ...] | None = None  # the last push's, when it all went into one segment
        self.as_announced = False  # whether the last push matched the handle `announce` gave for it

    def announce(self) -> SharedWeights | None:
        """The next push's handle before any byte is written -- the last push's layout, in the same segment --
        or None while the layout is not settled (the first two pushes, or more than one segment)."""
        if self.layout is None or len(self.segments) != 1 or self._consolidates():
            return None
        return SharedWeights(self.segments[0].path, self.generation + 1, self.layout)

    def _consolidates(self) -> bool:
        return bool(self.needed and self.segments) and (len(self.segments) > 1
                                                        or self.segments[0].tensor.numel() > 2 * self.needed)

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
              announced: SharedWeights | None = None) -> Iterator[SharedWeights]:
        """Copy the tensors into the segments in order and yield a handle per bucket as soon as its bytes are
        in place (so engines load it while the next is copied). A bucket ends at ``bucket_bytes`` or at the end
        of a segment. Segments are added when the tensors outgrow them (the first push, or a larger model);
        the second push moves into one segment of exactly the first one's size. `SegmentUnavailable` when
        shared memory cannot hold them: the handles yielded so far stay valid, and the tensor that did not
        fit is the exception's ``unwritten``. ``announced``: this push's handle from `announce`, already
        with the engines; the written mark says whether the push matched it (``as_announced``), also when
        the push ends early (an exception, here or in ``named_tensors``)."""
        self.generation += 1
        self.as_announced = False
        if self._consolidates():
            self._consolidate()
        for segment in self.segments:  # before any byte changes: handles from earlier pushes are now stale
            _generation(segment.tensor).fill_(self.generation)
        laid: list[TensorMeta] = []
        try:
            yield from self._write(named_tensors, bucket_bytes, laid)
        except BaseException:
            self._mark(-self.generation)  # engines waiting on an announced handle load nothing from it
            raise
        self.layout = tuple(laid) if len(self.segments) == 1 else None  # one segment: it holds them all
        self.as_announced = announced is not None and self.layout is not None and announced == SharedWeights(
            self.segments[0].path, self.generation, self.layout)
        self._mark(self.generation if announced is None or self.as_announced else -self.generation)

    def _mark(self, written: int) -> None:
        for segment in self.segments:
            _written(segment.tensor).fill_(written)

    def _write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, laid: list[TensorMeta]
               ) -> Iterator[SharedWeights]:
        import torch

        from miles_agent.transports.shm import SegmentUnavailable

        index, offset, used = 0, HEADER_BYTES, 0
        bucket: list[TensorMeta] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # the bucket's (segment region, tensor bytes)
        bucket_size = 0
        for name, t in named_tensors:
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            if index >= len(self.segments) or offset + nbytes > self.segments[index].tensor.numel():
                if bucket:
                    yield self._filled(index, bucket, copies)
                    bucket, bucket_size = [], 0
                if index < len(self.segments) and offset > HEADER_BYTES:
                    index += 1  # the rest of this segment is too small for the tensor
                offset = HEADER_BYTES
                if index >= len(self.segments) or nbytes + HEADER_BYTES > self.segments[index].tensor.numel():
                    try:
                        self._make(index, nbytes)
                    except SegmentUnavailable as e:
                        e.unwritten = (name, t)  # taken from the caller's iterator: it must not be lost
                        raise
            region = self.segments[index].tensor[offset:offset + nbytes]
            copies.append((region, t.contiguous().reshape(-1).view(torch.uint8)))
            meta = TensorMeta(name, tuple(t.shape), dtype_name(t), offset, offset + nbytes, nbytes)
            bucket.append(meta)
            laid.append(meta)
            offset = _aligned(offset + nbytes)
            used += _aligned(nbytes)
            bucket_size += nbytes
            if bucket_size >= bucket_bytes:
                yield self._filled(index, bucket, copies)
                bucket, bucket_size = [], 0
        if bucket:
            yield self._filled(index, bucket, copies)
        self.needed = used

    def _consolidate(self) -> None:
        """One segment of exactly what the last push needed, in place of the first push's (sized while its
        tensors were still unknown). Kept as they are if shared memory cannot hold the new one as well."""
        from miles_agent.transports.shm import SegmentUnavailable, SharedSegment

        try:
            segment = SharedSegment(HEADER_BYTES + self.needed)
        except SegmentUnavailable:
            return
        self.close()
        self.segments = [segment]

    def _make(self, index: int, nbytes: int) -> None:
        """A new segment at ``index`` that holds ``nbytes`` (a smaller one there is replaced: deleted, so no
        engine keeps it mapped)."""
        from miles_agent.transports.shm import SharedSegment

        segment = SharedSegment(max(self.min_segment_bytes, HEADER_BYTES + nbytes))
        _generation(segment.tensor).fill_(self.generation)
        if index < len(self.segments):
            self.segments[index].close()
            self.segments[index] = segment
        else:
            self.segments.append(segment)

    def _filled(self, index: int, metas: list[TensorMeta], copies: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> SharedWeights:
        """Copy a bucket's tensors into segment ``index`` (together: on a few threads), then its handle."""
        copy_many_(copies)
        copies.clear()
        return SharedWeights(self.segments[index].path, self.generation, tuple(metas))

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() for s in self.segments)

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        self.segments = []


def _wake_address(engine_id: str) -> str:
    """An engine's wake-up socket: Linux's abstract namespace (no file to clean up, gone with the process)."""
    return f"\0miles-agent-weights-written-{engine_id}"


def wake_engines(engine_ids: Iterable[str]) -> None:
    """Rank 0, once an announced push's written mark is set: wake the engines waiting on it. Best effort --
    an engine not listening yet reads the mark before it waits, and one that never hears it polls."""
    if not sys.platform.startswith("linux"):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for engine_id in engine_ids:
            with contextlib.suppress(OSError):  # not bound (yet), or its queue is full: it polls
                sock.sendto(b"w", _wake_address(engine_id))


class WrittenWaiter:
    """An engine's wait for an announced push's bytes (see the module docstring)."""

    POLL_S = 0.05  # without a wake-up (none on macOS, or one missed): how often the mark is read again
    TIMEOUT_S = 600.0  # rank 0 alive but never done: give up rather than keep the engine paused for ever

    def __init__(self, engine_id: str) -> None:
        self.sock: socket.socket | None = None
        if sys.platform.startswith("linux"):
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind(_wake_address(engine_id))
                sock.setblocking(False)
                self.sock = sock
            except OSError:  # e.g. the name is taken by an engine of another Ray session with the same id
                self.sock = None

    def wait(self, handle: SharedWeights) -> bool:
        """Block until rank 0 has written ``handle``'s bytes: True, or False when it laid that push out
        otherwise (the engine loads nothing from this handle; the real ones follow). `WeightSyncError` when a
        later push has started, or rank 0 is gone. Runs on the engine's loading thread."""
        import select

        from miles_agent.transports.shm import segment_owner_alive

        header = handle.header()
        deadline = time.monotonic() + self.TIMEOUT_S
        next_look = 0.0  # when to look again whether rank 0 still lives (a file open per look)
        while True:
            self._drain()  # before reading the mark: a wake-up that comes after it is not lost
            written = int(_written(header).item())
            if abs(written) == handle.generation:
                return written > 0
            if int(_generation(header).item()) > handle.generation:
                raise WeightSyncError(f"the weights in {handle.path} were overwritten by a later push before "
                                      f"this one (generation {handle.generation}) was written: push again")
            now = time.monotonic()
            if now >= next_look:
                if not segment_owner_alive(handle.path) or now > deadline:
                    raise WeightSyncError(f"the trainer stopped writing the weights in {handle.path} (generation "
                                          f"{handle.generation}) part way: it died or hangs")
                next_look = now + self.POLL_S
            if self.sock is None:
                time.sleep(0.001)
            else:
                select.select([self.sock], [], [], self.POLL_S)

    def _drain(self) -> None:
        if self.sock is None:
            return
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self.sock.recv(16)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
