"""Reading safetensors shards straight into existing tensors: what an engine's disk weight update needs
(one copy from the page cache, no second host buffer)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from miles_agent.transports.core import TensorMeta, WeightSyncError

if TYPE_CHECKING:  # pragma: no cover
    import torch

# safetensors dtype codes -> torch dtype names
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_header(path: Path) -> tuple[int, list[TensorMeta]]:
    """A safetensors file's tensor table: (byte offset of the data section, one TensorMeta per tensor with
    offsets relative to it). The format: 8-byte little-endian header length, a JSON header, the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise WeightSyncError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        n = struct.unpack("<Q", head)[0]
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise WeightSyncError(f"{path} is not a safetensors file (its header is not JSON)") from e
    metas = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise WeightSyncError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader lacks")
        begin, end = info["data_offsets"]
        metas.append(TensorMeta(name, tuple(info["shape"]), _DTYPES[info["dtype"]], begin, end, end - begin))
    return 8 + n, sorted(metas, key=lambda m: m.start_idx)


def read_into(path: Path, data_start: int, metas: list[TensorMeta], destinations: list[torch.Tensor]) -> None:
    """Read each tensor's bytes straight into its (CPU, contiguous) destination: one copy from the page cache."""
    import torch

    with open(path, "rb", buffering=0) as f:
        for m, dest in zip(metas, destinations, strict=True):
            view = memoryview(dest.view(-1).view(torch.uint8).numpy())
            if len(view) != m.numel:
                raise WeightSyncError(f"{path}: tensor {m.name!r} holds {m.numel} bytes, its destination {len(view)}")
            f.seek(data_start + m.start_idx)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise WeightSyncError(f"{path} ends inside tensor {m.name!r}: the file is truncated")
                got += n
