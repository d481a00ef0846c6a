"""The in-band header of a streamed distributed push (transports/stream.py): what rank 0 broadcasts is read
back as the same layout by a receiver, however long the layout; the end marker ends the push; a receiver out
of step with its sender says so instead of reading garbage. The broadcasts are a queue here: each one the
receiver posts is filled with the next tensor the sender put on the wire."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from miles_agent.transports.core import WeightSyncError, bucket_metadata
from miles_agent.transports.stream import HEADER_BYTES, end_tensors, header_tensors, receive_header


def wire_to(sent: list[torch.Tensor]):
    queue = deque(sent)

    def broadcast(t: torch.Tensor) -> None:
        src = queue.popleft()
        assert src.shape == t.shape and src.dtype == t.dtype, "the receiver posted a different broadcast"
        t.copy_(src)

    return broadcast, queue


def layout(n: int, name_len: int = 20) -> list:
    names = [f"model.layers.{i}." + "x" * name_len for i in range(n)]
    return bucket_metadata(names, ["bfloat16" if i % 2 else "float32" for i in range(n)],
                           [[i + 1, 3] for i in range(n)], flat=False)


@pytest.mark.parametrize("tensors", [1, 47, 3000])  # 3000 long names overflow the fixed header
def test_a_header_reads_back_as_the_layout_it_announced(tensors):
    metas = layout(tensors, name_len=40)
    sent = [*header_tensors(metas, "cpu"), *end_tensors("cpu")]
    assert sent[0].numel() == HEADER_BYTES and len(sent) == (3 if tensors == 3000 else 2)
    broadcast, queue = wire_to(sent)
    assert receive_header(broadcast, "cpu") == metas
    assert receive_header(broadcast, "cpu") is None and not queue  # the end marker, and nothing left over


def test_a_receiver_out_of_step_names_the_cause():
    broadcast, _ = wire_to([torch.full((HEADER_BYTES,), 0xFF, dtype=torch.uint8)])  # e.g. tensor bytes
    with pytest.raises(WeightSyncError, match="out of step with the sender"):
        receive_header(broadcast, "cpu")
    garbled = bytearray(HEADER_BYTES)
    garbled[:8] = (5).to_bytes(8, "little")
    garbled[8:13] = b"{oops"
    broadcast, _ = wire_to([torch.frombuffer(garbled, dtype=torch.uint8)])
    with pytest.raises(WeightSyncError, match="unreadable header .*out of step"):
        receive_header(broadcast, "cpu")
