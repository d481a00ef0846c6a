"""Trainer rank 0's side of an object-store push (``sync.transport=object-store``): the weights go to every
engine actor bucket by bucket, and each engine loads a bucket while rank 0 prepares the next.

Two carriers, one protocol (`EngineActor.sync_weights_part`):

- engines on rank 0's node (and shared memory to spare): the bytes go into shared-memory segments that rank 0
  keeps from push to push, and a handle crosses Ray (runtime/shared_weights.py);
- otherwise (an engine on another node, ``sync.shared_memory=false``, or no room in /dev/shm): ``ray.put`` of
  each bucket, which Ray moves between nodes.

A push that runs out of shared memory part way sends the rest through ``ray.put``: the gather is a
collective, so rank 0 cannot start it again; later pushes then use ``ray.put`` only.

Once the shared-memory layout has settled, a push is announced: each engine gets its one handle before rank
0 writes, and waits for the bytes (runtime/shared_weights.py). Rank 0 answers the driver as soon as
everything is sent; the driver waits for the engines' loads (`PendingLoads`).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from miles_agent.runtime.shared_weights import SharedWeights, SharedWeightsWriter, wake_engines

log = logging.getLogger(__name__)


class StoreSender:
    """What rank 0 keeps between pushes: the shared-memory segments and each engine actor's node."""

    def __init__(self, shm_dir: str = "/dev/shm") -> None:
        self.shm_dir = shm_dir
        self.writer = SharedWeightsWriter()
        self.engine_nodes: dict[str, str] = {}  # actor id -> node id
        self.unavailable: str | None = None  # why shared memory is off for good (logged once)

    def shared_memory_reaches(self, engines: list[Any]) -> bool:
        """Whether every engine can map rank 0's segments: all on this node, and room for them."""
        import ray

        if self.unavailable is not None:
            return False
        if not self.writer.segments:  # first push: a tmpfs smaller than one segment (Docker's 64 MiB) is no use
            try:
                free = os.statvfs(self.shm_dir)
                room = free.f_bavail * free.f_frsize
            except OSError:
                room = 0
            if room < self.writer.min_segment_bytes:
                self.turn_off(f"{self.shm_dir} has {room >> 20} MiB free, less than one "
                          f"{self.writer.min_segment_bytes >> 20} MiB segment")
                return False
        try:
            nodes = self._nodes(engines)
        except Exception:  # noqa: BLE001 - a dead engine: the ray.put path's loads report it as such
            return False
        return all(node == ray.get_runtime_context().get_node_id() for node in nodes)

    def _nodes(self, engines: list[Any]) -> list[str]:
        import ray

        ids = [e._actor_id.hex() for e in engines]
        unknown = [(i, e) for i, e in zip(ids, engines) if i not in self.engine_nodes]
        if unknown:
            for (i, _), node in zip(unknown, ray.get([e.node_id.remote() for _, e in unknown])):
                self.engine_nodes[i] = node
        return [self.engine_nodes[i] for i in ids]

    def turn_off(self, reason: str) -> None:
        self.unavailable = reason
        log.warning("object-store weight sync: shared memory off (%s); pushing through ray.put instead. "
                    "Give the machine more shared memory (a container: --shm-size) to go faster, or set "
                    "sync.shared_memory=false to silence this", reason)

    def close(self) -> None:
        self.writer.close()


def pipelines(device: str, colocated: bool) -> bool:
    """Whether engines on this node should load each shared-memory bucket while rank 0 writes the next.
    Never colocated: the engines take the device back only after the gather gives it up. Host weights: only
    with cores for both sides' copy threads -- on fewer, the two sides' copies only slow each other down
    (and each extra load call costs a Ray round trip), so one load per segment after the writes is faster."""
    import torch

    from miles_agent.transports.core import copy_threads, usable_cores

    if colocated:
        return False
    return torch.device(device).type != "cpu" or usable_cores() >= 2 * copy_threads()


def merged(handles: list[SharedWeights]) -> list[SharedWeights]:
    """Consecutive handles into one segment as one handle (one load call instead of several)."""
    out: list[SharedWeights] = []
    for h in handles:
        if out and out[-1].path == h.path and out[-1].generation == h.generation:
            out[-1] = SharedWeights(h.path, h.generation, out[-1].metas + h.metas)
        else:
            out.append(h)
    return out


class StorePush:
    """One push: ``write`` during the gather, ``finish`` after it (the trainer's device may be given back to
    colocated engines in between)."""

    def __init__(self, sender: StoreSender, engines: list[Any], version: int, bucket_bytes: int) -> None:
        self.sender, self.engines, self.version, self.bucket_bytes = sender, engines, version, bucket_bytes
        self.id = uuid.uuid4().hex  # a retried push of the same version counts its buckets afresh
        self.handles: list[Any] = []  # SharedWeights, then ObjectRefs of what went through ray.put
        self.loads: list[list[Any]] = []  # per dispatched bucket: one sync_weights_part call per engine
        self.early = 0  # buckets sent while writing, before their count was known (`pipelines`)
        self.announced: SharedWeights | None = None  # sent before writing (`SharedWeightsWriter.announce`)
        self.packed: Any = None  # what is left for ray.put (`PackedWeights`)
        self.nbytes = 0
        self.started = time.perf_counter()  # made as the gather starts

    def write(self, named_tensors: Iterable[tuple[str, Any]], shared: bool, dispatch: bool, staging: list[Any],
              announce: bool = False) -> None:
        """Rank 0 reads the gathered weights (all of them: the gather is a collective). ``shared``: into the
        segments, each bucket sent on (``dispatch``) as soon as it is in place; the rest, or everything,
        packed for ``ray.put`` in `finish`. Not ``dispatch`` (`pipelines`): the engines load after the
        writes, one call per segment -- or, with ``announce`` (engines that may pause while rank 0 gathers:
        not colocated) and a settled layout, the whole push's handle goes to them before the first byte is
        written, and they wait for the bytes (the call's latency and their pause overlap the writes)."""
        from miles_agent.runtime.packed_weights import pack_weights
        from miles_agent.transports.shm import SegmentUnavailable

        rest: Iterable[tuple[str, Any]] = named_tensors
        if shared and announce and not dispatch:
            self.announced = self.sender.writer.announce()
            if self.announced is not None:  # counted as this push's one part only if the push matches it
                self.loads.append([e.sync_weights_part.remote(self.announced, self.version, self.id, 0, 1, True)
                                   for e in self.engines])
        try:
            if shared:
                tensors = iter(named_tensors)
                try:
                    for handle in self.sender.writer.write(tensors, self.bucket_bytes, self.announced):
                        self._add(handle, dispatch)
                    rest = ()
                except SegmentUnavailable as e:
                    self.sender.turn_off(str(e))
                    rest = itertools.chain([e.unwritten], tensors) if e.unwritten is not None else tensors
            self.packed = pack_weights(rest, staging)
        except BaseException:
            if self.announced is not None:  # the engines paused for a push that will not come: they go on
                for e in self.engines:
                    e.sync_weights_abandoned.remote(self.id)
            raise

    def finish(self) -> list[Any]:
        """Send what is left: ``[handles, stats, pending]`` (bytes, buckets, those through shared memory, and
        rank 0's gather with its shared-memory writes; the `PendingLoads` of every engine). Rank 0 returns
        these at once: the driver waits for the loads itself (`PendingLoads.wait`), so this answer crosses
        while the engines load instead of after (their answers still pass through rank 0, which owns the calls)."""
        import ray

        written = time.perf_counter()
        if self.announced is not None:  # the written mark is set: as announced, or not (then the handles follow)
            wake_engines(e._actor_id.hex() for e in self.engines)
        early = self.early
        self.handles[early:] = merged(self.handles[early:])  # written but held back: one load per segment
        shared = len(self.handles)
        buckets = self.packed.split(self.bucket_bytes) if self.packed is not None and self.packed.parts else []
        total = shared + len(buckets)  # the engines resume once they have loaded this many
        matched = self.announced is not None and self.sender.writer.as_announced  # then the engines have it all
        for handle in [] if matched else self.handles[early:]:
            self._dispatch(handle, total)
        for bucket in buckets:
            ref = ray.put(bucket)
            self.handles.append(ref)
            self.nbytes += bucket.nbytes
            self._dispatch(ref, total)
        done = [e.sync_weights_done.remote(self.id, total) for e in self.engines] if early else []
        stats = {"sync_bytes": float(self.nbytes), "sync_buckets": float(total), "sync_shared_buckets": float(shared),
                 "sync_announced": float(matched), "sync_write_s": written - self.started}
        return [self.handles, stats, PendingLoads(self.loads, done, len(self.engines))]

    def _add(self, handle: SharedWeights, dispatch: bool) -> None:
        self.handles.append(handle)
        self.nbytes += handle.nbytes
        if dispatch:
            self._dispatch(handle, 0)
            self.early += 1

    def _dispatch(self, handle: Any, parts: int) -> None:
        """Every engine loads ``handle``: part number ``len(self.loads)`` of ``parts`` (0: not known yet)."""
        part = len(self.loads)
        self.loads.append([e.sync_weights_part.remote(handle, self.version, self.id, part, parts)
                           for e in self.engines])


@dataclass
class PendingLoads:
    """The engines' load calls of one push, waited for by whoever holds this (the driver: rank 0 hands it back
    as soon as everything is sent). ``loads``: per bucket, one call per engine; ``done``: the bucket counts
    sent after parts that went out before it was known."""

    loads: list[list[Any]]
    done: list[Any]
    engines: int

    def wait(self) -> dict[str, float]:
        """Until every engine has loaded every bucket: the engines whose memory had been released, and how
        long the wait took. An engine that dies fails the push with `WeightSyncError` (the supervisor replaces
        it and pushes again)."""
        import ray

        from miles_agent.runtime.supervisor import actor_failures
        from miles_agent.transports.core import WeightSyncError

        started = time.perf_counter()
        try:
            answers = ray.get([ref for per_bucket in self.loads for ref in per_bucket] + self.done)
        except actor_failures() as e:  # not the trainer's failure: the driver must not take it for one
            raise WeightSyncError(f"an engine died while loading the pushed weights ({type(e).__name__})") from None
        n = self.engines
        released = sum(any(answers[i * n + j] for i in range(len(self.loads))) for j in range(n))
        return {"engine_memory_resumed": float(released), "sync_load_wait_s": time.perf_counter() - started}
