"""Trainer rank 0's shared-memory segments for object-store pushes to engines on its node
(runtime/shared_weights.py, runtime/store_push.py), without Ray: what another process reads through a
handle is exactly what was written, byte for byte and dtype for dtype; segments are reused from push to
push; a handle from an earlier push refuses to load; running out of shared memory part way sends the
rest through ``ray.put`` without losing or repeating a tensor; and an engine told of a push before its bytes
are written waits for them, woken by rank 0, and is not left waiting on a push that will not come."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import pickle
import signal
import threading
import time
import uuid

import pytest
import torch

from miles_agent.runtime.shared_weights import (
    SharedWeights,
    SharedWeightsWriter,
    WrittenWaiter,
    _written,
    wake_engines,
)
from miles_agent.runtime.store_push import StorePush, StoreSender, merged
from miles_agent.transports.core import TensorMeta, WeightSyncError


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(300, 64, generator=g)),  # 75 KiB
            ("norm", torch.randn(64, generator=g).to(torch.bfloat16)),  # 2-byte elements between 4-byte ones
            ("steps", torch.randint(0, 1 << 40, (3,), generator=g)),
            ("odd", torch.randn(7, generator=g).to(torch.float16)),  # 14 bytes: the next one must be realigned
            ("big", torch.randn(512, 160, generator=g)),  # 320 KiB: more than a segment on its own
            ("scalar", torch.tensor(2.5)),
            ("head", torch.randn(64, 300, generator=g).t())]  # not contiguous


def read_in_another_process(payload: bytes) -> list[tuple[str, str, tuple, bytes]]:
    handles = pickle.loads(payload)
    out = []
    for handle in handles:
        for name, t in handle.tensors():
            out.append((name, str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()))
        handle.check()
    return out


def test_another_process_reads_every_tensor_exactly_and_a_second_push_reuses_the_segments():
    writer = SharedWeightsWriter(min_segment_bytes=256 << 10)
    try:
        first = weights(0)
        handles = list(writer.write(iter(first), bucket_bytes=64 << 10))
        paths = [s.path for s in writer.segments]
        assert len(paths) >= 2 and len(handles) > len(paths)  # several segments, several buckets in one
        assert all(m.start_idx % 64 == 0 for h in handles for m in h.metas)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            got = pool.apply(read_in_another_process, (pickle.dumps(handles),))
        assert [g[0] for g in got] == [n for n, _ in first]
        for (name, dtype, shape, raw), (_, t) in zip(got, first, strict=True):
            assert (dtype, shape) == (str(t.dtype), tuple(t.shape)), name
            assert raw == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name

        second = weights(1)  # moves into one segment of exactly the size the first push needed
        again = list(writer.write(iter(second), bucket_bytes=64 << 10))
        (exact,) = writer.segments
        aligned = sum(-(-m.numel // 64) * 64 for h in again for m in h.metas)
        assert exact.tensor.numel() == 64 + aligned  # the header, then every tensor 64-byte aligned: no slack
        assert not any(os.path.exists(p) for p in paths)  # the first push's files are gone
        for name, t in (nt for h in again for nt in h.tensors()):
            assert torch.equal(t, dict(second)[name]), name

        third = weights(2)  # from now on the same memory: no new file, no page faulted in anew
        last = list(writer.write(iter(third), bucket_bytes=64 << 10))
        assert writer.segments == [exact] and {h.generation for h in last} == {again[0].generation + 1}
        for name, t in (nt for h in last for nt in h.tensors()):
            assert torch.equal(t, dict(third)[name]), name
        with pytest.raises(WeightSyncError, match="overwritten by a later push"):
            again[0].tensors()  # a handle kept from the push before (a restart after a failed push)
    finally:
        writer.close()
    assert not os.path.exists(exact.path)  # closing deletes the file


def test_a_handle_whose_segment_is_gone_says_why_and_how_to_turn_it_off(tmp_path):
    handle = SharedWeights(str(tmp_path / "gone"), 1, (TensorMeta("w", (2,), "float32", 64, 72, 8),))
    with pytest.raises(WeightSyncError, match="another node.*sync.shared_memory=false"):
        handle.tensors()


def test_running_out_of_shared_memory_part_way_sends_the_rest_through_ray_put(monkeypatch, caplog):
    """The gather is a collective: rank 0 cannot start it again, so what did not fit is packed for ray.put
    and every tensor goes exactly once; later pushes skip shared memory."""
    real = os.posix_fallocate
    made = []

    def fallocate(fd, offset, length):
        if made:  # the second segment does not fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        made.append(length)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    sender = StoreSender()
    sender.writer.min_segment_bytes = 256 << 10
    tensors = weights(2)
    push = StorePush(sender, engines=[], version=1, bucket_bytes=64 << 10)
    try:
        push.write(iter(tensors), shared=True, dispatch=False, staging=[])
        shared = [n for h in push.handles for n, _ in h.tensors()]
        packed = [n for n, _ in push.packed.tensors()]
        assert shared and packed and shared + packed == [n for n, _ in tensors]
        for name, t in [*(nt for h in push.handles for nt in h.tensors()), *push.packed.tensors()]:
            assert torch.equal(t, dict(tensors)[name]), name
        assert "No space left" in sender.unavailable and "shared memory off" in caplog.text
        assert not sender.shared_memory_reaches([])  # for good: later pushes go through ray.put
    finally:
        sender.close()


def test_a_tmpfs_smaller_than_one_segment_is_not_used(monkeypatch, caplog):
    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", lambda path: Tiny())
    sender = StoreSender()
    assert not sender.shared_memory_reaches([])
    assert "has 0 MiB free" in sender.unavailable and "--shm-size" in caplog.text


def settled(writer: SharedWeightsWriter) -> None:
    """Two pushes: the second moves into one segment of the exact size, so the layout has settled."""
    for seed in (10, 11):
        list(writer.write(iter(weights(seed)), bucket_bytes=64 << 10))


def test_an_announced_push_matches_the_handle_sent_before_its_bytes_or_marks_that_it_does_not():
    """Rank 0 sends the engines the next push's handle before writing (the last push's layout in the same
    segment); the header's written mark then says whether the bytes are in place as announced (+generation)
    or the push was laid out otherwise or abandoned (-generation): engines wait on that mark."""
    writer = SharedWeightsWriter(min_segment_bytes=256 << 10)
    try:
        assert writer.announce() is None  # nothing laid out yet
        list(writer.write(iter(weights(10)), bucket_bytes=64 << 10))
        assert writer.announce() is None  # the next push moves into one exact segment: a new file
        list(writer.write(iter(weights(11)), bucket_bytes=64 << 10))
        (segment,) = writer.segments

        announced = writer.announce()
        assert announced is not None and announced.generation == writer.generation + 1
        handles = list(writer.write(iter(weights(12)), bucket_bytes=64 << 10, announced=announced))
        assert writer.as_announced and merged(handles) == [announced]
        assert _written(segment.tensor).item() == announced.generation
        for name, t in announced.tensors():
            assert torch.equal(t, dict(weights(12))[name]), name

        other = [(n, t[:400] if n == "big" else t) for n, t in weights(13)]  # a smaller tensor: another layout
        announced = writer.announce()
        handles = list(writer.write(iter(other), bucket_bytes=64 << 10, announced=announced))
        assert not writer.as_announced and merged(handles) != [announced]
        assert _written(segment.tensor).item() == -announced.generation  # the waiting engines load nothing
        for name, t in (nt for h in handles for nt in h.tensors()):
            assert torch.equal(t, dict(other)[name]), name

        def failing():
            yield from weights(14)[:2]
            raise RuntimeError("a trainer rank died in the gather")

        announced = writer.announce()
        assert announced is not None and announced.metas == merged(handles)[0].metas  # the last push's layout
        with pytest.raises(RuntimeError, match="gather"):
            list(writer.write(failing(), bucket_bytes=64 << 10, announced=announced))
        assert _written(segment.tensor).item() == -announced.generation
    finally:
        writer.close()


def test_an_engine_waiting_on_an_announced_push_is_woken_when_the_bytes_are_in_place():
    writer = SharedWeightsWriter(min_segment_bytes=256 << 10)
    engine_id = f"test-{uuid.uuid4().hex}"
    waiter = WrittenWaiter(engine_id)
    waiter.POLL_S = 30.0  # without the wake-up each wait would take this long
    try:
        settled(writer)
        for tensors, as_announced in ((weights(20), True), (list(reversed(weights(21))), False)):
            announced = writer.announce()

            def rank0(tensors=tensors, announced=announced):
                time.sleep(0.2)  # the engine is waiting by then
                list(writer.write(iter(tensors), bucket_bytes=64 << 10, announced=announced))
                wake_engines([engine_id])

            thread = threading.Thread(target=rank0)
            thread.start()
            started = time.monotonic()
            assert waiter.wait(announced) is as_announced  # in the wrong order: load nothing from it
            assert 0.2 <= time.monotonic() - started < 10
            thread.join()
        stale = SharedWeights(announced.path, announced.generation - 1, announced.metas)
        with pytest.raises(WeightSyncError, match="overwritten by a later push"):
            waiter.wait(stale)
    finally:
        waiter.close()
        writer.close()


def _own_segments(pipe) -> None:
    writer = SharedWeightsWriter(min_segment_bytes=256 << 10)
    settled(writer)
    pipe.send(writer.announce())
    time.sleep(3600)


def test_an_engine_waiting_on_a_push_whose_trainer_died_gives_up_with_the_cause():
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    owner = ctx.Process(target=_own_segments, args=(theirs,), daemon=True)
    owner.start()
    try:
        announced = ours.recv()
        waiter = WrittenWaiter(f"test-{uuid.uuid4().hex}")
        waiter.POLL_S = 0.05
        os.kill(owner.pid, signal.SIGKILL)
        owner.join()
        with pytest.raises(WeightSyncError, match="stopped writing.*died"):
            waiter.wait(announced)
        waiter.close()
    finally:
        owner.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(announced.path)
