"""Benchmark: each weight-sync transport's bandwidth against a raw baseline moving the same bytes.

The trainer is this process; the engine is a separate process holding only the model
(``EngineProcess(serve=False)``), so every transport crosses a real process boundary. Per repeat,
interleaved so machine noise hits both alike:

- shm          vs raw shared memory: bucket by bucket (the same buckets), copy the tensors into a
               preallocated shared buffer and have another process copy them out into its own buffer
               (the two memcpys and the one hand-off per bucket any shm transfer needs);
- distributed  vs raw gloo broadcasts of the same tensors into preallocated buffers of the same shapes;
- disk         vs raw safetensors: ``save_file`` of all tensors into one file, then ``load_file`` with
               the ``pread`` backend (the default mmap one returns before reading the bytes).

A ratio is baseline time / transport time (= transport bandwidth / raw bandwidth); the goal is >= 0.8.
Each transport's first push runs with the check mode on (and must pass); timed pushes run without it.
Prints min/median/max ratios over the repeats and writes JSON with the machine's description.

    python bench/weight_sync.py            # 208 MiB of fp32 weights in 64 MiB buckets, 5 repeats (a minute)
    python bench/weight_sync.py --quick    # 26 MiB in 8 MiB buckets, 5 repeats (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles_agent.engines.embedded.process import EngineProcess
from miles_agent.transports import DiskTransport, DistributedTransport, SharedMemoryTransport
from miles_agent.transports.core import flat_buckets
from miles_agent.transports.groups import free_port, init_custom_process_group

GOAL = 0.8


class BenchModel(torch.nn.Module):
    """Transformer-shaped fp32 weights: per layer 4 attention matrices (h x h), 3 MLP ones (h x 3h), 2 norms."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        h = hidden
        shapes = {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "o_proj": (h, h), "gate_proj": (3 * h, h),
                  "up_proj": (3 * h, h), "down_proj": (h, 3 * h), "input_norm": (h,), "post_norm": (h,)}
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            for name, shape in shapes.items():
                layer.register_parameter(name, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
            self.layers.append(layer)


def bench_model(hidden: int, layers: int) -> BenchModel:
    return BenchModel(hidden, layers)


def raw_child(conn, shared: torch.Tensor, port: int, shapes: list[tuple[int, ...]], total: int) -> None:  # noqa: ANN001
    """The raw baselines' other process: copy shared-buffer prefixes out, or receive gloo broadcasts."""
    torch.set_num_threads(1)
    dest = torch.empty(total, dtype=torch.uint8)
    recv = [torch.empty(s) for s in shapes]
    group = init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, "raw_baseline")
    while (cmd := conn.recv()) is not None:
        if cmd == "gloo":
            for buf in recv:
                torch.distributed.broadcast(buf, 0, group)
        else:  # (offset, nbytes) of the next bucket
            offset, n = cmd
            dest[offset:offset + n].copy_(shared[:n])
        conn.send("done")


def raw_shm(conn, shared: torch.Tensor, bucketed: list[list[tuple[str, torch.Tensor]]]) -> None:  # noqa: ANN001
    offset = 0
    for bucket in bucketed:
        n = 0
        for _, t in bucket:
            size = t.numel() * t.element_size()
            shared[n:n + size].copy_(t.reshape(-1).view(torch.uint8))
            n += size
        conn.send((offset, n))
        assert conn.recv() == "done"
        offset += n


def raw_gloo(conn, group, named: list[tuple[str, torch.Tensor]]) -> None:  # noqa: ANN001
    conn.send("gloo")
    for _, t in named:
        torch.distributed.broadcast(t, 0, group)
    assert conn.recv() == "done"


def raw_disk(folder: Path, named: list[tuple[str, torch.Tensor]]) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "raw.safetensors"
    save_file(dict(named), str(path))
    load_file(str(path), backend="pread")  # the default mmap backend is lazy: it would not read the bytes
    path.unlink()


def timed(fn, *args) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0]}


def summary(ratios: list[float]) -> dict:
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=64, help="sync.bucket_mb's default")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="folder for the disk transport (default: a temporary folder)")
    ap.add_argument("--json", default="runs/bench/weight_sync.json", help="where to write the results")
    ap.add_argument("--start-method", default="fork", choices=["fork", "spawn"],
                    help="how the engine and baseline processes start (fork: fast; spawn: as with CUDA)")
    ap.add_argument("--quick", action="store_true", help="hidden 512, 2 layers (26 MiB), 8 MiB buckets, 5 repeats")
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.repeat, a.bucket_mb = 512, 2, 5, 8
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = bench_model(a.hidden, a.layers)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    named = [(n, t.detach()) for n, t in model.state_dict().items()]
    total = sum(t.numel() * t.element_size() for _, t in named)
    bucket_bytes = a.bucket_mb << 20
    bucketed = list(flat_buckets(named, bucket_bytes))
    folder = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="weight_sync_bench_"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{total / 2**20:.0f} MiB fp32 in {len(named)} tensors, {a.bucket_mb} MiB buckets, {a.repeat} repeats, "
          f"disk folder {folder}")

    # fork: both children start before this process has any thread (gloo's come later), in a second
    # instead of re-importing torch; the start method changes nothing that is timed.
    ctx = mp.get_context(a.start_method)
    shared = torch.empty(max(sum(t.numel() * t.element_size() for _, t in b) for b in bucketed),
                         dtype=torch.uint8).share_memory_()
    port = free_port()
    conn, child_conn = ctx.Pipe()
    raw = ctx.Process(target=raw_child, args=(child_conn, shared, port, [tuple(t.shape) for _, t in named], total), daemon=True)
    raw.start()
    child_conn.close()  # so a crashed child shows up here as EOF instead of a hang
    engine = EngineProcess(functools.partial(bench_model, a.hidden, a.layers), serve=False, num_threads=1,
                           start_method=a.start_method).start()
    raw_group = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, "raw_baseline")
    common = dict(bucket_bytes=bucket_bytes)
    transports = {"shm": SharedMemoryTransport([engine], **common),
                  "distributed": DistributedTransport([engine], backend="gloo", **common),
                  "disk": DiskTransport([engine], root=folder / "weights", keep=1, **common)}
    baselines = {"shm": functools.partial(raw_shm, conn, shared, bucketed),
                 "distributed": functools.partial(raw_gloo, conn, raw_group, named),
                 "disk": functools.partial(raw_disk, folder, named)}
    times: dict[str, dict[str, list[float]]] = {k: {"transport": [], "raw": []} for k in transports}

    async def run() -> None:
        for kind, tr in transports.items():  # warm-up: group, staging buffers, page cache; checked once
            tr.check = True
            await tr.push(named, version=1)
            tr.check = False
            baselines[kind]()
        for r in range(a.repeat):
            for kind, tr in transports.items():
                t = time.perf_counter()
                await tr.push(named, version=2 + r)
                times[kind]["transport"].append(time.perf_counter() - t)
                times[kind]["raw"].append(timed(baselines[kind]))
        await transports["distributed"].close()

    try:
        asyncio.run(run())
    finally:
        conn.send(None)
        raw.join(10)
        engine.close()
        if not a.dir:
            shutil.rmtree(folder, ignore_errors=True)

    results = {}
    print(f"{'transport':12s} {'GB/s':>7s} {'raw GB/s':>9s}   ratio min / median / max   (goal >= {GOAL})")
    for kind, tm in times.items():
        ratios = [b / t for t, b in zip(tm["transport"], tm["raw"])]
        gbps = total / statistics.median(tm["transport"]) / 1e9
        raw_gbps = total / statistics.median(tm["raw"]) / 1e9
        s = summary(ratios)
        ok = "ok" if s["median"] >= GOAL else "BELOW GOAL"
        print(f"{kind:12s} {gbps:7.2f} {raw_gbps:9.2f}   {s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}   {ok}")
        results[kind] = {"bandwidth_gbps": gbps, "raw_bandwidth_gbps": raw_gbps, "ratio": s,
                         "seconds": tm["transport"], "raw_seconds": tm["raw"],
                         "baseline": {"shm": "per bucket: memcpy into shared memory, memcpy out in another process",
                                      "distributed": "gloo broadcasts of the same tensors",
                                      "disk": "safetensors save_file + load_file(backend='pread')"}[kind]}
    out = {"bench": "weight_sync", "bytes": total, "tensors": len(named), "bucket_bytes": bucket_bytes,
           "repeat": a.repeat, "quick": a.quick, "goal_ratio": GOAL, "machine": machine_info(), "results": results}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
