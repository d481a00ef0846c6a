"""Disk weight sync: the trainer writes each version as an HF-style safetensors folder, atomically, and
the engines load it (SGLang's ``update_weights_from_disk`` with ``model_path``).

Layout: ``<root>/v00000003/`` holding ``model-00001.safetensors`` ... (one shard per bucket) and
``model.safetensors.index.json`` (``weight_map``: engine name -> shard). The folder is built under a
temporary name and renamed into place, so an engine never sees half a version; the newest ``keep``
versions stay on disk. Works across machines on a shared filesystem; extra memory is one shard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_agent.atomic import replace_dir
from miles_agent.transports.base import EngineTransport
from miles_agent.transports.core import buckets
from miles_agent.transports.receiver import WeightReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch

_VERSION_DIR = re.compile(r"^v(\d{8})$")


def write_version(named_tensors: Iterable[tuple[str, torch.Tensor]], path: Path, bucket_bytes: int
                  ) -> dict[str, float]:
    """Write the tensors as safetensors shards plus an index under ``path``, atomically."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total, n = 0, 0
    for i, bucket in enumerate(buckets(named_tensors, bucket_bytes)):
        shard = f"model-{i + 1:05d}.safetensors"
        tensors, seen = {}, set()
        for name, t in bucket:
            t = t.detach().contiguous().cpu()
            if t.data_ptr() in seen:  # tied weights: safetensors refuses two names on one storage
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
            weight_map[name] = shard
            total += t.numel() * t.element_size()
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        n += 1
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    replace_dir(tmp, path)
    return {"sync_bytes": float(total), "sync_buckets": float(n)}


class DiskTransport(EngineTransport):
    """Engines load each version from a folder the trainer wrote (a shared filesystem across machines)."""

    kind = "disk"

    def __init__(self, engines: list[WeightReceiver], *, root: str | Path, keep: int = 2, **kwargs: Any) -> None:
        super().__init__(engines, **kwargs)
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the version the engines load), got {keep}")
        self.root = Path(root)
        self.keep = keep

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    async def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        import asyncio

        self.root.mkdir(parents=True, exist_ok=True)
        return await asyncio.to_thread(write_version, named_tensors, self.version_dir(version), self.bucket_bytes)

    async def load(self, version: int) -> None:
        """Have every engine load the folder of ``version`` (already written)."""
        path = str(self.version_dir(version).resolve())
        await self._each(lambda e: e.update_weights_from_disk(model_path=path, weight_version=str(version)))

    async def _send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        stats = await self.write(named_tensors, version)
        await self.load(version)
        self._prune()
        return stats

    def _prune(self) -> None:
        versions = sorted(p for p in self.root.iterdir() if _VERSION_DIR.match(p.name))
        for old in versions[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
