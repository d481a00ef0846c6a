"""The transport a ``sync`` config section asks for, over the engines `components.build_engines` made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_agent.config import SyncConfig
from miles_agent.errors import UserError
from miles_agent.weight_sync.core import InProcessTransport, WeightTransport, prefix_map
from miles_agent.weight_sync.receiver import LocalReceiver, WeightReceiver

TRANSPORTS = ("inprocess", "shm", "distributed", "disk")


def build_transport(sync: SyncConfig, engines: list[Any], *, run_dir: str, device: str) -> WeightTransport:
    if sync.transport not in TRANSPORTS:
        raise UserError(f"unknown sync.transport {sync.transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if sync.bucket_mb < 1:
        raise UserError(f"sync.bucket_mb must be >= 1, got {sync.bucket_mb}")
    common = dict(bucket_bytes=sync.bucket_mb << 20, check=sync.check,
                  name_map=prefix_map(sync.strip_prefix, sync.add_prefix))
    if sync.transport == "inprocess":
        if any(isinstance(e, WeightReceiver) for e in engines):
            raise UserError("sync.transport=inprocess needs in-process engines (rollout.engine=local); "
                            "these engines live in other processes: use sync.transport=shm, distributed or disk")
        return InProcessTransport(engines, **common)
    if sync.transport == "distributed":
        from miles_agent.weight_sync.dist import DistributedTransport

        if not all(isinstance(e, WeightReceiver) for e in engines):
            raise UserError("sync.transport=distributed needs engines in their own processes (they join a "
                            "process group with the trainer); with the in-process local engine use "
                            "sync.transport=inprocess, shm or disk")
        backend = sync.backend if sync.backend != "auto" else ("nccl" if device.startswith("cuda") else "gloo")
        if backend not in ("gloo", "nccl"):
            raise UserError(f"sync.backend must be gloo, nccl or auto, got {sync.backend!r}")
        return DistributedTransport(engines, backend=backend, master_address=sync.master_address,
                                    master_port=sync.master_port, **common)
    receivers = [e if isinstance(e, WeightReceiver) else LocalReceiver(e) for e in engines]
    if sync.transport == "shm":
        from miles_agent.weight_sync.shm import SharedMemoryTransport

        return SharedMemoryTransport(receivers, **common)
    from miles_agent.weight_sync.disk import DiskTransport

    if sync.disk_keep < 1:
        raise UserError(f"sync.disk_keep must be >= 1, got {sync.disk_keep}")
    root = Path(sync.disk_dir) if sync.disk_dir else Path(run_dir) / "weights"
    return DiskTransport(receivers, root=root, keep=sync.disk_keep, **common)
