"""Full weights as a few flat byte buffers: the form in which they cross Ray's object store.

Ray stores a numpy array with one memcpy and hands it to readers on the same node zero-copy, from
shared memory; a list of torch tensors is pickled instead, several times slower for the same bytes
(``python bench/weight_sync_ray.py``). So the trainer ranks, the supervisor and the engine actors pass
`PackedWeights`: uint8 numpy arrays with SGLang-style metadata -- flat buckets of device tensors (split
where dtypes change alignment), or byte views of host tensors, one each.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_agent.transports.core import TensorMeta, bucket_metadata, dtype_name, flat_buckets, pack, unpack

if TYPE_CHECKING:  # pragma: no cover
    import torch

BUCKET_BYTES = 256 << 20  # GPU weights are packed on the device first: this bounds that extra memory


@dataclass(frozen=True)
class PackedWeights:
    parts: list[tuple[Any, list[TensorMeta]]]  # (1-D uint8 numpy array, the tensors in it): a bucket or one tensor

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a, _ in self.parts)

    def split(self, max_bytes: int) -> list[PackedWeights]:
        """The parts in consecutive groups of at most ``max_bytes`` (a larger part goes alone): what is put in
        the object store one group at a time, so engines load one group while the next is put."""
        groups: list[list[tuple[Any, list[TensorMeta]]]] = []
        size = 0
        for part in self.parts:
            if not groups or (size + int(part[0].nbytes) > max_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(part)
            size += int(part[0].nbytes)
        return [PackedWeights(g) for g in groups]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Named views (no copy). Arrays read from the object store are read-only: load from these views
        (copy them into parameters), never write to them."""
        import torch

        out = []
        with warnings.catch_warnings():  # torch warns that the read-only buffer is shared, which is the point
            warnings.simplefilter("ignore", UserWarning)
            for array, metas in self.parts:
                out.extend(unpack(torch.from_numpy(array), metas))
        return out


def pack_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], staging: list[Any] | None = None
                 ) -> PackedWeights:
    """The tensors as host byte buffers. Device tensors are packed where they are, then copied to host
    once per bucket; with ``staging`` (a list the caller keeps), host buffers are reused from one call to
    the next (a fresh 200 MB buffer costs as much in page faults as the copy itself). Host tensors are not
    copied at all: each is a part of its own, a byte view of the tensor -- packing them first was a third
    memcpy on a path whose floor is two (``ray.put`` into the store, the engine's load out of it).
    Either way the result aliases memory that changes later (the staging buffers, the trainer's own
    tensors): ``ray.put`` it (which copies) right away, before packing again or training."""
    import torch

    parts = []
    for i, bucket in enumerate(flat_buckets(((n, t.detach()) for n, t in named_tensors), BUCKET_BYTES)):
        device = bucket[0][1].device
        if device.type == "cpu":  # no copy at all: each tensor's bytes as they are (ray.put copies them once)
            for name, t in bucket:
                flat = t.contiguous().reshape(-1).view(torch.uint8)
                parts.append((flat.numpy(), bucket_metadata([name], [dtype_name(t)], [list(t.shape)])))
            continue
        host = None
        if staging is not None:
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            if len(staging) <= i:
                staging.append(torch.empty(0, dtype=torch.uint8))
            if staging[i].numel() < nbytes:
                staging[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            host = staging[i]
        flat, metas = pack(bucket, out=host if device.type == "cpu" else None)
        if host is not None and device.type != "cpu":
            host[:flat.numel()].copy_(flat)
            flat = host[:flat.numel()]
        parts.append((flat.cpu().numpy(), metas))
    return PackedWeights(parts)


def named_tensors(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """Tensors from `PackedWeights`, `SharedWeights` (runtime/shared_weights.py) or a list of (name, tensor)."""
    from miles_agent.runtime.shared_weights import SharedWeights

    return weights.tensors() if isinstance(weights, PackedWeights | SharedWeights) else list(weights)
