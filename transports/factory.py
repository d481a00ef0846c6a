"""The entry points of the ``miles_agent.transports`` group: one builder per ``sync.transport`` name.

Each takes the ``sync`` config section and the engines the run built, in this process
(``cluster.mode=inprocess``); under Ray the runtime picks its own transports (runtime/launch.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_agent.config import SyncConfig
from miles_agent.errors import UserError
from miles_agent.transports.core import InProcessTransport, WeightTransport, prefix_map
from miles_agent.transports.receiver import InProcessReceiver, WeightReceiver


def _common(sync: SyncConfig) -> dict[str, Any]:
    if sync.bucket_mb < 1:
        raise UserError(f"sync.bucket_mb must be >= 1, got {sync.bucket_mb}")
    return dict(bucket_bytes=sync.bucket_mb << 20, check=sync.check,
                name_map=prefix_map(sync.strip_prefix, sync.add_prefix))


def _receivers(engines: list[Any]) -> list[WeightReceiver]:
    return [e if isinstance(e, WeightReceiver) else InProcessReceiver(e) for e in engines]


def build_inprocess(sync: SyncConfig, engines: list[Any], *, run_dir: str, device: str) -> WeightTransport:
    """Tensors handed to in-process engines by reference (the embedded engine's default)."""
    common = _common(sync)
    if any(isinstance(e, WeightReceiver) for e in engines):
        raise UserError("sync.transport=inprocess needs in-process engines (rollout.engine=embedded); "
                        "these engines live in other processes: use sync.transport=shm, distributed or disk")
    return InProcessTransport(engines, **common)


def build_shm(sync: SyncConfig, engines: list[Any], *, run_dir: str, device: str) -> WeightTransport:
    """Buckets as shared-memory (CPU) or CUDA IPC (GPU) handles, for colocated engines."""
    from miles_agent.transports.shm import SharedMemoryTransport

    return SharedMemoryTransport(_receivers(engines), **_common(sync))


def build_distributed(sync: SyncConfig, engines: list[Any], *, run_dir: str, device: str) -> WeightTransport:
    """A torch.distributed group from the trainer to engines in their own processes (gloo / NCCL)."""
    from miles_agent.transports.dist import DistributedTransport

    common = _common(sync)
    if not all(isinstance(e, WeightReceiver) for e in engines):
        raise UserError("sync.transport=distributed needs engines in their own processes (they join a "
                        "process group with the trainer); with the in-process embedded engine use "
                        "sync.transport=inprocess, shm or disk")
    backend = sync.backend if sync.backend != "auto" else ("nccl" if device.startswith("cuda") else "gloo")
    if backend not in ("gloo", "nccl"):
        raise UserError(f"sync.backend must be gloo, nccl or auto, got {sync.backend!r}")
    return DistributedTransport(engines, backend=backend, master_address=sync.master_address,
                                master_port=sync.master_port, **common)


def build_disk(sync: SyncConfig, engines: list[Any], *, run_dir: str, device: str) -> WeightTransport:
    """A versioned safetensors folder per version, written atomically, loaded by the engines."""
    from miles_agent.transports.disk import DiskTransport

    common = _common(sync)
    if sync.disk_keep < 1:
        raise UserError(f"sync.disk_keep must be >= 1, got {sync.disk_keep}")
    root = Path(sync.disk_dir) if sync.disk_dir else Path(run_dir) / "weights"
    return DiskTransport(_receivers(engines), root=root, keep=sync.disk_keep, **common)
