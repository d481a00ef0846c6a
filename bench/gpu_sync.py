"""Weight sync for the GPU check: the project's transports against the raw operation they are built on.

* CUDA IPC (``shm`` transport on CUDA: a bucket crosses as a CUDA IPC handle) to an engine process on the
  same GPU, against one device-to-device copy of the same tensors (the floor any colocated sync pays);
* NCCL (``distributed`` transport) to an engine process on a second GPU, against raw NCCL broadcasts of the
  same tensors into preallocated buffers there. NCCL refuses two ranks on one GPU, so with one GPU this part
  is reported as skipped, with the reason.

On CPU (the dry run) the same code runs with shared memory and gloo in place of CUDA IPC and NCCL.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from miles_agent.engines.embedded.process import EngineProcess
from miles_agent.transports import DistributedTransport, SharedMemoryTransport
from miles_agent.transports.groups import free_port, init_custom_process_group


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def raw_copy_s(named: list[tuple[str, torch.Tensor]], device: str) -> float:
    dst = [torch.empty_like(t) for _, t in named]
    _sync(device)
    t0 = time.perf_counter()
    for d, (_, t) in zip(dst, named):
        d.copy_(t)
    _sync(device)
    return time.perf_counter() - t0


def _raw_receiver(conn: Any, backend: str, port: int, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                  device: str, repeat: int) -> None:
    """The raw broadcast baseline's other rank: receive every tensor into its preallocated buffer."""
    group = init_custom_process_group(backend, "127.0.0.1", port, 1, 2, "raw_broadcast")
    bufs = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    for _ in range(repeat + 1):
        for b in bufs:
            torch.distributed.broadcast(b, 0, group)
        _sync(device)
        conn.send("done")


def raw_broadcast_s(named: list[tuple[str, torch.Tensor]], backend: str, device: str, repeat: int,
                    child_env: dict[str, str]) -> list[float]:
    ctx = mp.get_context("spawn")
    port = free_port()
    conn, child_conn = ctx.Pipe()
    with _env(child_env):
        proc = ctx.Process(target=_raw_receiver, daemon=True, args=(
            child_conn, backend, port, [tuple(t.shape) for _, t in named], named[0][1].dtype,
            "cuda" if device.startswith("cuda") else "cpu", repeat))
        proc.start()
    group = init_custom_process_group(backend, "127.0.0.1", port, 0, 2, "raw_broadcast")
    times = []
    try:
        for r in range(repeat + 1):  # the first round is the warm-up (communicator setup)
            t0 = time.perf_counter()
            for _, t in named:
                torch.distributed.broadcast(t, 0, group)
            _sync(device)
            assert conn.recv() == "done"
            if r:
                times.append(time.perf_counter() - t0)
    finally:
        torch.distributed.destroy_process_group(group)
        proc.join(30)
    return times


class _env:
    """Environment variables for a child started inside the block (the NCCL peer sees only the second GPU)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values, self.saved = values, {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _push_times(transport: Any, named: list[tuple[str, torch.Tensor]], repeat: int) -> list[float]:
    transport.check = True  # the first push is verified tensor by tensor, then timed pushes run unchecked
    await transport.push(named, version=1)
    transport.check = False
    times = []
    for r in range(repeat):
        t0 = time.perf_counter()
        await transport.push(named, version=2 + r)
        times.append(time.perf_counter() - t0)
    close = getattr(transport, "close", None)
    if close is not None:
        await close()
    return times


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def check_weight_sync(model: torch.nn.Module, model_fn: Callable[[], torch.nn.Module], device: str,
                      bucket_mb: int = 256, repeat: int = 3) -> dict[str, Any]:
    """GB/s of each transport and of its raw baseline, moving ``model``'s weights to an engine process that
    holds ``model_fn()`` (same names and shapes)."""
    named = [(n, t.detach()) for n, t in model.state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    cuda = device.startswith("cuda")
    out: dict[str, Any] = {"bytes": nbytes, "bucket_mb": bucket_mb}

    engine = EngineProcess(model_fn, serve=False, device=device, start_method="spawn").start()
    try:
        ipc = asyncio.run(_push_times(SharedMemoryTransport([engine], bucket_bytes=bucket_mb << 20), named, repeat))
    finally:
        engine.close()
    copy = [raw_copy_s(named, device) for _ in range(repeat)]
    out["cuda_ipc" if cuda else "shm"] = {"gbps": _gbps(nbytes, ipc), "raw_device_copy_gbps": _gbps(nbytes, copy),
                                          "ratio": statistics.median(copy) / statistics.median(ipc)}

    backend = "nccl" if cuda else "gloo"
    if cuda and torch.cuda.device_count() < 2:
        out[backend] = {"skipped": "NCCL needs the engine on a second GPU (it refuses two ranks on one device); "
                                   f"{torch.cuda.device_count()} visible"}
        return out
    child_env = {"CUDA_VISIBLE_DEVICES": "1"} if cuda else {}
    with _env(child_env):
        engine = EngineProcess(model_fn, serve=False, device="cuda:0" if cuda else "cpu", start_method="spawn").start()
    try:
        dist = asyncio.run(_push_times(DistributedTransport([engine], backend=backend, bucket_bytes=bucket_mb << 20),
                                       named, repeat))
    finally:
        engine.close()
    raw = raw_broadcast_s(named, backend, device, repeat, child_env)
    out[backend] = {"gbps": _gbps(nbytes, dist), "raw_broadcast_gbps": _gbps(nbytes, raw),
                    "ratio": statistics.median(raw) / statistics.median(dist)}
    return out
