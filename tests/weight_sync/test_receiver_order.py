"""The receiver takes a broadcast's buckets in the order they were sent, whatever order its calls start in.

A Ray actor starts async calls in no guaranteed order, and the sender announces bucket n+1 while bucket n
is still being received; two receives in flight on one gloo group match the wrong messages, and gloo
aborts the whole engine process ("Received data size doesn't match expected size" -- it killed an engine
actor in bench/weight_sync_ray.py). Here ``torch.distributed.broadcast`` is replaced by a recorder, so the
order is checked without a group (the real broadcasts run in tests/weight_sync/test_ws_transports.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from miles_agent.transports.core import WeightSyncError
from miles_agent.transports.receiver import InProcessReceiver, ModelHolder


@pytest.fixture
def receiver(monkeypatch):
    calls: list[tuple[str, int]] = []
    busy = threading.Lock()

    def broadcast(t, src, group):  # noqa: ANN001
        if not busy.acquire(blocking=False):
            raise AssertionError("two receives in flight on one group")
        try:
            calls.append(("recv", t.numel()))
            time.sleep(0.005)
        finally:
            busy.release()

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    model = torch.nn.Sequential(*(torch.nn.Linear(n, 1, bias=False) for n in (2, 3, 4)))
    rx = InProcessReceiver(ModelHolder(model))
    rx._groups["g"] = object()
    rx._next_bucket["g"] = rx._arrived["g"] = 0
    return rx, calls


def announce(i: int) -> dict:
    return dict(names=[f"{i}.weight"], dtypes=["float32"], shapes=[[1, i + 2]], group_name="g")


def test_numbered_buckets_are_received_in_order_when_started_out_of_order(receiver):
    rx, calls = receiver

    async def main():
        tasks = [asyncio.create_task(rx.update_weights_from_distributed(**announce(i), bucket=i)) for i in (2, 0, 1)]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert calls == [("recv", 2), ("recv", 3), ("recv", 4)]


def test_unnumbered_buckets_are_received_one_at_a_time_in_arrival_order(receiver):
    rx, calls = receiver

    async def main():
        await asyncio.gather(*(rx.update_weights_from_distributed(**announce(i)) for i in range(3)))

    asyncio.run(main())
    assert calls == [("recv", 2), ("recv", 3), ("recv", 4)]


def test_a_bucket_whose_predecessor_never_comes_fails_with_the_cause(receiver):
    rx, _ = receiver

    async def main():
        await rx._wait_turn("g", 1, timeout_s=0.05)

    with pytest.raises(WeightSyncError, match="bucket 1 .* waited .* for bucket 0"):
        asyncio.run(main())


def test_destroying_the_group_fails_the_waiting_buckets(receiver, monkeypatch):
    rx, _ = receiver
    monkeypatch.setattr("miles_agent.transports.groups.destroy_group", lambda group: None)

    async def main():
        waiting = asyncio.create_task(rx.update_weights_from_distributed(**announce(1), bucket=1))
        await asyncio.sleep(0.01)
        await rx.destroy_weights_update_group("g")
        await waiting

    with pytest.raises(WeightSyncError, match="destroyed while bucket 1 waited"):
        asyncio.run(main())
