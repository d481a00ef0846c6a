"""Distributed weight sync: trainer rank 0 broadcasts flat buckets to the engines over a torch.distributed
group of its own (gloo on CPU, NCCL on GPU), shaped like SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``.

Handshake: the trainer asks every engine to join group ``group_name`` at master address/port with
``rank_offset`` (engine i is rank 1 + i; the trainer is rank 0) and ``world_size`` = 1 + engines, while
joining it itself. Per bucket it announces names, dtypes and shapes, then broadcasts:

- ``flatten=False`` (default): one broadcast per tensor, straight from the trainer's tensor into the
  engine's parameter when dtype and shape match -- no copy on either side (SGLang's default load format,
  where the engine loads from a received copy instead). Extra memory: none on the trainer's side (gloo
  with GPU weights stages one tensor on the host), mismatching tensors of one bucket on the engine's.
- ``flatten=True``: the bucket packed into one uint8 tensor (``load_format="flattened_bucket"``), one
  broadcast per bucket, one copy on each side; fewer collectives when there are many small tensors.
  Extra memory: one bucket on each side.

The group is separate from any trainer process group (it is built the way SGLang's engines build
theirs, a TCP rendezvous and a group-name key prefix, so a real SGLang server can join a trainer's group).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles_agent.transports.base import EngineTransport
from miles_agent.transports.core import (
    WeightSyncError,
    bucket_metadata,
    buckets,
    dtype_name,
    flat_buckets,
    pack,
)
from miles_agent.transports.groups import (
    DEFAULT_GROUP,
    destroy_group,
    free_port,
    init_custom_process_group,
    unused_group_name,
)
from miles_agent.transports.receiver import WeightReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch


class DistributedTransport(EngineTransport):
    """Broadcast buckets from this process (trainer rank 0) to engines that join a weight-update group."""

    kind = "distributed"

    def __init__(self, engines: list[WeightReceiver], *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: int = 0, group_name: str = DEFAULT_GROUP, timeout_s: float = 300.0,
                 flatten: bool = False, stream: bool | None = None, **kwargs: Any) -> None:
        super().__init__(engines, **kwargs)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        cannot = [i for i, e in enumerate(engines) if not getattr(e, "receives_streams", False)]
        if stream and (cannot or flatten):
            raise ValueError("stream=True needs per-tensor buckets (flatten=False) and engines that take a "
                             "streamed push (receives_streams); " + (f"engines {cannot} do not (an SGLang server "
                             "takes per-bucket requests): leave stream unset" if cannot else "set flatten=False"))
        # Streamed (transports/stream.py) when every engine can take it: the wire protocol is one per group.
        self.stream = not flatten and not cannot if stream is None else stream
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.flatten = flatten
        self.group: Any = None
        self.active_group = group_name  # a broken group is abandoned and the next one gets a new name
        self._staging: torch.Tensor | None = None

    async def connect(self) -> None:
        """Form the group: every engine joins as rank 1 + i while this process joins as rank 0."""
        port = self.master_port or free_port(self.master_address)
        world = 1 + len(self.engines)
        self.active_group = unused_group_name(self.group_name)
        joins = [asyncio.ensure_future(e.init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=1 + i, world_size=world,
            group_name=self.active_group, backend=self.backend)) for i, e in enumerate(self.engines)]
        own = asyncio.ensure_future(asyncio.to_thread(
            init_custom_process_group, self.backend, self.master_address, port, 0, world, self.active_group,
            self.timeout_s))
        await _all_or_first_error([own, *joins], "forming the weight update group")
        self.group = own.result()

    async def close(self) -> None:
        if self.group is None:
            return
        group, self.group = self.group, None
        await self._each(lambda e: e.destroy_weights_update_group(group_name=self.active_group))
        destroy_group(group)

    async def _send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        import torch

        if self.group is None:
            await self.connect()
        device = torch.device("cuda" if self.backend == "nccl" else "cpu")
        if self.stream:
            return await self._send_stream(named_tensors, version, device)
        if self.flatten and self._staging is None:
            self._staging = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        # Per-tensor buckets need no staging, so the next one is announced and queued for broadcast while
        # the engines still load the last: the per-bucket round trip overlaps the data transfer.
        depth = 1 if self.flatten else 2
        inflight: deque[tuple[asyncio.Future, list[asyncio.Future], str]] = deque()
        total, n, carried = 0, 0, 0
        lane = _SendLane()
        # From bucket 1 on, one bucket of lookahead, so the last one is known when it is announced: a receiver that
        # can (an engine actor) resumes generation itself once that bucket has loaded, and the push's continue costs
        # no round trip after the transfer. Bucket 0 goes out at once (a gather ahead would delay the whole push), so
        # a one-bucket push resumes by a call; so does one with the checksum check, which reads the weights first.
        # The cost: with several trainer ranks, one more bucket of gathered tensors held at a time.
        buckets = flat_buckets(named_tensors, self.bucket_bytes)
        bucket, upcoming = next(buckets, None), None
        try:
            while bucket is not None:
                if n > 0:
                    upcoming = next(buckets, None)
                last = n > 0 and upcoming is None
                if self.flatten:
                    flat, metas = pack(bucket, out=self._staging)
                    wire = [flat]
                else:
                    metas = bucket_metadata([name for name, _ in bucket], [dtype_name(t) for _, t in bucket],
                                            [list(t.shape) for _, t in bucket])
                    wire = [outgoing(name, t, device) for name, t in bucket]
                if self.backend == "nccl":
                    torch.cuda.current_stream().synchronize()
                announce = dict(names=[m.name for m in metas], dtypes=[m.dtype for m in metas],
                                shapes=[list(m.shape) for m in metas], group_name=self.active_group,
                                weight_version=str(version),
                                load_format="flattened_bucket" if self.flatten else None)
                fold = [last and not self.check and getattr(e, "resumes_after_last_bucket", False)
                        for e in self.engines]  # the last bucket carries the resume (see above)
                receives = [asyncio.ensure_future(e.update_weights_from_distributed(
                    **announce, **({"resume": True} if resume else {}))) for e, resume in zip(self.engines, fold)]
                carried = sum(fold)
                inflight.append((lane.submit(wire, self.group), receives, f"bucket {n} (first tensor {metas[0].name!r})"))
                total += metas[-1].end_idx
                n += 1
                while len(inflight) >= depth:
                    await self._finish(*inflight.popleft())
                bucket = next(buckets, None) if n == 1 else upcoming
            while inflight:
                await self._finish(*inflight.popleft())
        finally:
            lane.close()
            for send, receives, _ in inflight:  # after a failure: consume what is still pending
                for f in (send, *receives):
                    f.add_done_callback(lambda f: f.cancelled() or f.exception())
        return {"sync_bytes": float(total), "sync_buckets": float(n), "sync_broadcast_s": lane.busy,
                "sync_resumes_carried": float(carried)}

    async def _send_stream(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int,
                           device: torch.device) -> dict[str, float]:
        """The whole push as one request per engine, the layout in band (transports/stream.py). At most two
        buckets are gathered and queued for broadcast at a time, as in the per-bucket protocol."""
        import torch

        from miles_agent.transports.stream import end_tensors, header_tensors

        resume = [not self.check and getattr(e, "resumes_after_last_bucket", False) for e in self.engines]
        receives = [asyncio.ensure_future(e.receive_weights_stream(
            group_name=self.active_group, weight_version=str(version), **({"resume": True} if r else {})))
            for e, r in zip(self.engines, resume)]
        await asyncio.sleep(0)  # the requests go out now: the engines get ready while the first bucket is gathered
        sends: deque[tuple[asyncio.Future, str]] = deque()
        last_send: asyncio.Future | None = None
        total, n = 0, 0
        lane = _SendLane()
        try:
            for bucket in buckets(named_tensors, self.bucket_bytes):  # tensor by tensor: no dtype alignment
                metas = bucket_metadata([name for name, _ in bucket], [dtype_name(t) for _, t in bucket],
                                        [list(t.shape) for _, t in bucket], flat=False)
                wire = [*header_tensors(metas, device), *(outgoing(name, t, device) for name, t in bucket)]
                if self.backend == "nccl":
                    torch.cuda.current_stream().synchronize()
                last_send = lane.submit(wire, self.group)
                sends.append((last_send, f"bucket {n} (first tensor {metas[0].name!r})"))
                total += metas[-1].end_idx
                n += 1
                while len(sends) >= 2:
                    await self._sent(*sends.popleft(), receives)
            last_send = lane.submit(end_tensors(device), self.group)
            await self._finish(last_send, receives, "ending the streamed push")
        except BaseException:
            for f in (*(send for send, _ in sends), *receives, *([last_send] if last_send else [])):
                f.add_done_callback(lambda f: f.cancelled() or f.exception())  # what is still pending, consumed
            raise
        finally:
            lane.close()
        return {"sync_bytes": float(total), "sync_buckets": float(n), "sync_broadcast_s": lane.busy,
                "sync_resumes_carried": float(sum(resume)), "sync_streamed": 1.0}

    async def _sent(self, send: asyncio.Future, what: str, receives: list[asyncio.Future]) -> None:
        """Wait for one bucket's broadcast of a streamed push. A stream ends only after the last bucket, so
        an engine whose receive ended meanwhile has failed: its error is raised at once."""
        await asyncio.wait([send, *receives], return_when=asyncio.FIRST_COMPLETED)
        early = [i for i, r in enumerate(receives) if r.done() and not r.cancelled() and r.exception() is None]
        if early:
            self.group = None  # that engine no longer receives: the group is out of step
            raise WeightSyncError(f"distributed weight sync failed while {what}: engine {early[0]} ended its "
                                  "streamed receive before the end of the push")
        if not (send.done() and send.exception() is None and not any(r.done() for r in receives)):
            await self._finish(send, receives, what)  # raises the first error, naming who failed

    async def _finish(self, send: asyncio.Future, receives: list[asyncio.Future], what: str) -> None:
        try:
            await _all_or_first_error([send, *receives], what)
        except WeightSyncError:
            if not send.done():  # an engine failed first: did our side of the broadcast finish anyway?
                await asyncio.wait([send], timeout=10.0)
            if not (send.done() and not send.cancelled() and send.exception() is None):
                self.group = None  # a half-done broadcast leaves the group unusable
            raise


class _SendLane:
    """One thread that runs a push's broadcasts in the order they were queued, so the next bucket's starts the
    moment the last one ends -- no hop through the event loop and a fresh worker thread between two buckets
    while the engines wait. After a failed broadcast the group is out of step: nothing queued later is sent."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weights-send")
        self.busy = 0.0  # seconds spent inside broadcasts (the rest of a send waited on the engines)
        self.failed = False

    def submit(self, wire: list[torch.Tensor], group: Any) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.pool, self._broadcast, wire, group)

    def _broadcast(self, wire: list[torch.Tensor], group: Any) -> None:
        if self.failed:
            raise WeightSyncError("not sent: an earlier broadcast of this push failed")
        t0 = time.perf_counter()
        try:
            _broadcast_all(wire, group)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.busy += time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=False)  # a broadcast stuck in a broken group cannot be interrupted


def outgoing(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor as it goes on the wire: on the group's device, contiguous (no copy when it already is)."""
    return t.to(device).contiguous()


def _broadcast_all(tensors: list[torch.Tensor], group: Any) -> None:
    import torch.distributed as dist

    for t in tensors:
        dist.broadcast(t, 0, group)


async def _all_or_first_error(futures: list[asyncio.Future], what: str) -> None:
    """Wait for all; if any fails first, raise at once (a peer stuck in a collective would never return).
    Pending ones are left running (a thread in a collective cannot be cancelled); their errors are consumed."""
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    for i, f in enumerate(futures):
        if f in done and f.exception() is not None:
            for p in pending:
                p.add_done_callback(lambda p: p.cancelled() or p.exception())
            who = "trainer" if i == 0 else f"engine {i - 1}"
            err = f.exception()
            raise WeightSyncError(f"distributed weight sync failed while {what}: {who}: "
                                  f"{type(err).__name__}: {err}") from err

