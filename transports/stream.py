"""The streamed form of a distributed weight push: one request per engine per push, the layout in band.

SGLang's ``update_weights_from_distributed`` announces every bucket with a request of its own, then the
sender broadcasts it. Under Ray each announcement is an actor call (1-4 ms) and a hop onto the engine's
receive thread, paid per bucket while the sender waits (``python bench/weight_sync_ray.py`` measured the
per-bucket protocol 10-20 ms slower than the same broadcasts received in one loop). Receivers that can
(``receives_streams = True``: the embedded engine in-process, in a process of its own, or as a Ray actor)
take a whole push in one call instead, ``receive_weights_stream``: per bucket, rank 0 broadcasts a header
of fixed size -- the byte length of the bucket's layout, then its names, dtypes and shapes as JSON (a
layout too long for it continues in one more broadcast) -- and then the bucket's tensors one by one; a
layout length of 0 ends the push. An SGLang server keeps the per-bucket requests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_agent.transports.core import TensorMeta, WeightSyncError, bucket_metadata

if TYPE_CHECKING:  # pragma: no cover
    import torch


HEADER_BYTES = 32 << 10  # the fixed part of a header: one broadcast announces a bucket of a few hundred tensors


def header_tensors(metas: list[TensorMeta], device: Any) -> list[torch.Tensor]:
    """What announces a bucket on the wire: HEADER_BYTES holding the layout's byte length (8 bytes, little
    endian) and the JSON layout, and, only when the layout does not fit, one more tensor with the rest."""
    import torch

    layout = json.dumps({"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
                         "shapes": [list(m.shape) for m in metas]}).encode()
    framed = len(layout).to_bytes(8, "little") + layout
    head = bytearray(framed[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0"))
    wire = [torch.frombuffer(head, dtype=torch.uint8).to(device)]
    if len(framed) > HEADER_BYTES:
        wire.append(torch.frombuffer(bytearray(framed[HEADER_BYTES:]), dtype=torch.uint8).to(device))
    return wire


def end_tensors(device: Any) -> list[torch.Tensor]:
    """What ends a push on the wire: a header whose layout length is 0."""
    import torch

    return [torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)]


def receive_header(broadcast: Callable[[torch.Tensor], None], device: Any) -> list[TensorMeta] | None:
    """The next bucket's layout (``broadcast(t)`` receives into ``t``), or None at the end of the push."""
    import torch

    head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
    broadcast(head)
    framed = bytes(head.cpu().numpy())
    n = int.from_bytes(framed[:8], "little")
    if n == 0:
        return None
    if n >= 1 << 31:
        raise WeightSyncError(f"a streamed weight push announced a header of {n} bytes; the stream is out "
                              "of step with the sender (both sides must run the same miles-agent version)")
    if 8 + n > HEADER_BYTES:
        rest = torch.empty(8 + n - HEADER_BYTES, dtype=torch.uint8, device=device)
        broadcast(rest)
        framed += bytes(rest.cpu().numpy())
    try:
        layout = json.loads(framed[8:8 + n])
        return bucket_metadata(layout["names"], layout["dtypes"], layout["shapes"], flat=False)
    except (ValueError, KeyError, TypeError) as e:
        raise WeightSyncError(f"a streamed weight push sent an unreadable header ({type(e).__name__}: {e}); "
                              "the stream is out of step with the sender") from e
