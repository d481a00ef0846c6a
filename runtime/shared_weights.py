"""The object-store push for engines on trainer rank 0's own node: the bytes go through shared memory that
rank 0 keeps from push to push, and only a handle of a few hundred bytes goes through Ray.

Why not ``ray.put``: a put copies each array into store pages that the putting process may never have
touched (about 4x slower when it lands there, at random), and Ray's put starts six copy threads for every
array of 1 MiB or more (~10 ms per push of ~30 such tensors on two cores). A segment that lives as long as
the trainer has its pages in place after the first push, and each tensor is one plain copy in, one copy
out -- the floor of any copy between two processes. This is the CPU form of what colocated RL stacks do
on GPUs (SGLang's ``update_weights_from_tensor`` with CUDA IPC handles).

Layout: shared-memory files (transports/shm.py) -- after the first push, one of exactly the model's size --
each starting with a 64-byte header whose first int64 is the segment's generation. Rank 0 bumps the
generation of every segment before it overwrites any of them, so an engine that reads a handle from an
earlier push (a restart after a failed push) finds out instead of loading a mix of two versions. The
segments hold the last push whole: a restarted engine loads it from there (the supervisor keeps the
handles, as it kept object refs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_agent.transports.core import TensorMeta, WeightSyncError, copy_many_, dtype_name, unpack

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from miles_agent.transports.shm import SharedSegment

HEADER_BYTES = 64  # the generation, then padding: every tensor starts 64-byte aligned
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
        from miles_agent.transports.shm import attach_segment

        try:
            segment = attach_segment(self.path, max(m.end_idx for m in self.metas))
        except (FileNotFoundError, RuntimeError) as e:
            raise WeightSyncError(
                f"the trainer's weight segment {self.path} cannot be mapped here ({e}): the engine is on another "
                "node than trainer rank 0, or the trainer has closed. Set sync.shared_memory=false to push "
                "through Ray's object store") from None
        self._check(segment)
        return unpack(segment, self.metas)

    def check(self) -> None:
        """Raise if the trainer has started another push into this segment (call it after loading)."""
        from miles_agent.transports.shm import attach_segment

        self._check(attach_segment(self.path, HEADER_BYTES))

    def _check(self, segment: torch.Tensor) -> None:
        now = int(_generation(segment).item())
        if now != self.generation:
            raise WeightSyncError(
                f"the weights in {self.path} were overwritten by a later push (generation {now}, this handle's "
                f"{self.generation}): a push failed part way and left its predecessor's handles; push again")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _generation(segment: torch.Tensor) -> torch.Tensor:
    import torch

    return segment[:8].view(torch.int64)


class SharedWeightsWriter:
    """Trainer rank 0's side: the segments, reused by every push, and the copy of each push into them."""

    def __init__(self, min_segment_bytes: int = SEGMENT_BYTES) -> None:
        self.min_segment_bytes = min_segment_bytes
        self.segments: list[SharedSegment] = []
        self.generation = 0
        self.needed = 0  # the last whole push's bytes, as laid out (0: none yet)

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
              ) -> Iterator[SharedWeights]:
        """Copy the tensors into the segments in order and yield a handle per bucket as soon as its bytes are
        in place (so engines load it while the next is copied). A bucket ends at ``bucket_bytes`` or at the end
        of a segment. Segments are added when the tensors outgrow them (the first push, or a larger model);
        the second push moves into one segment of exactly the first one's size. `SegmentUnavailable` when
        shared memory cannot hold them: the handles yielded so far stay valid, and the tensor that did not
        fit is the exception's ``unwritten``."""
        import torch

        from miles_agent.transports.shm import SegmentUnavailable

        self.generation += 1
        if self.needed and (len(self.segments) > 1 or self.segments[0].tensor.numel() > 2 * self.needed):
            self._consolidate()
        for segment in self.segments:  # before any byte changes: handles from earlier pushes are now stale
            _generation(segment.tensor).fill_(self.generation)
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
            bucket.append(TensorMeta(name, tuple(t.shape), dtype_name(t), offset, offset + nbytes, nbytes))
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
