"""Benchmark: what the local sandbox costs per command and per episode, against a bare subprocess.

1. Exec latency of ``true``: ``LocalSandbox.exec("true")`` (bubblewrap: new user, mount, pid, net,
   ipc, uts namespaces, rlimits, a pids cgroup where writable) against a bare asyncio subprocess
   running ``true`` with the same pipes, measured interleaved in the same run; p50/p90 and ratios.
   ``isolation="none"`` is shown too (rlimits and cgroup, no namespaces).
   The overhead (p50 minus bare p50) is the figure to hold under 10 ms on an idle machine. On shared
   cores, this process's CPU time and voluntary context switches per exec (the round trips) are printed
   too: other jobs disturb them far less than wall time.
2. The same from a trainer-sized process (``--resident-gib``, default 2 GiB touched): spawning must
   not copy the caller's page tables (a fork instead of a vfork costs ~150 ms per command at 4 GiB).
3. Episode throughput: 32 sandboxes at once, each start -> 3 execs -> stop; episodes per second. Then
   how the cost grows: throughput at 1, 8, 32 and 128 concurrent sandboxes, and the time per episode at
   1, 3 and 10 commands each.

    python bench/sandbox_overhead.py           # ~30 s
    python bench/sandbox_overhead.py --quick   # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import time

from miles_agent.sandbox import SandboxSpec
from miles_agent.sandboxes.local import LocalSandbox


async def bare_true() -> None:
    proc = await asyncio.create_subprocess_exec(
        "true", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await proc.communicate()


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p90 in milliseconds."""
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples) * 1e3, q[8] * 1e3


CPU: dict[str, list[float]] = {}  # per variant: [this process's CPU seconds, voluntary context switches, runs]


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), ru.ru_nvcsw


async def exec_latency(iters: int, isolations: list[str]) -> dict[str, list[float]]:
    """Interleaved, so machine noise hits every variant alike. Also counts, per variant, this process's
    CPU time and voluntary context switches (each a wait on another thread or process: the round trips),
    which other jobs on shared cores disturb far less than wall time."""
    CPU.clear()
    boxes = {}
    for isolation in isolations:
        boxes[isolation] = LocalSandbox(isolation=isolation)
        await boxes[isolation].start(SandboxSpec())
    times: dict[str, list[float]] = {"bare": [], **{k: [] for k in boxes}}
    try:
        for _ in range(3):  # warm-up
            await bare_true()
            for box in boxes.values():
                await box.exec("true")
        for _ in range(iters):
            t, (c, v) = time.perf_counter(), _usage()
            await bare_true()
            times["bare"].append(time.perf_counter() - t)
            _count("bare", c, v)
            for name, box in boxes.items():
                t, (c, v) = time.perf_counter(), _usage()
                result = await box.exec("true")
                times[name].append(time.perf_counter() - t)
                _count(name, c, v)
                assert result.exit_code == 0, result
    finally:
        for box in boxes.values():
            await box.stop()
    return times


def _count(name: str, cpu0: float, vcsw0: int) -> None:
    cpu, vcsw = _usage()
    acc = CPU.setdefault(name, [0.0, 0, 0])
    acc[0], acc[1], acc[2] = acc[0] + cpu - cpu0, acc[1] + vcsw - vcsw0, acc[2] + 1


async def episode(isolation: str, execs: int) -> None:
    async with LocalSandbox(isolation=isolation) as box:
        await box.start(SandboxSpec(files={"task.txt": b"2+2\n"}))
        for i in range(execs):
            result = await box.exec(f"cat task.txt > out{i}.txt && wc -c < out{i}.txt")
            assert result.exit_code == 0, result


async def episodes_per_second(isolation: str, total: int, concurrency: int, execs: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> None:
        async with gate:
            await episode(isolation, execs)
    t = time.perf_counter()
    await asyncio.gather(*(gated() for _ in range(total)))
    return total / (time.perf_counter() - t)


def report(title: str, times: dict[str, list[float]], isolations: list[str]) -> None:
    bare50, bare90 = percentiles(times["bare"])
    print(title)
    print(f"  bare subprocess       p50 {bare50:7.2f} ms   p90 {bare90:7.2f} ms")
    for name in isolations:
        p50, p90 = percentiles(times[name])
        print(f"  local sandbox {name:<6}  p50 {p50:7.2f} ms   p90 {p90:7.2f} ms   ratio vs bare: p50 "
              f"{p50 / bare50:5.1f}x  p90 {p90 / bare90:5.1f}x   overhead p50 {p50 - bare50:6.2f} ms")
    for name in ["bare", *isolations]:
        cpu, vcsw, n = CPU.get(name, [0.0, 0, 1])
        print(f"  {name:<6} this process per exec: CPU {cpu / n * 1e3:5.2f} ms, {vcsw / n:4.1f} voluntary context "
              "switches")
    print(f"  load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a few seconds)")
    parser.add_argument("--resident-gib", type=float, default=2.0, help="size of the trainer-like process (0: skip)")
    args = parser.parse_args()
    iters, total = (40, 64) if args.quick else (200, 256)
    isolations = (["bwrap"] if shutil.which("bwrap") else []) + ["none"]
    if "bwrap" not in isolations:
        print("bwrap not found: only the unisolated mode is measured")

    report(f"exec latency of `true` ({iters} runs each, interleaved)", asyncio.run(exec_latency(iters, isolations)),
           isolations)
    if args.resident_gib > 0:
        ballast = bytearray(int(args.resident_gib * (1 << 30)))
        ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, not just reserved
        report(f"the same from a process with {args.resident_gib:g} GiB resident",
               asyncio.run(exec_latency(iters // 2, isolations)), isolations)
        del ballast

    print(f"episodes (start -> 3 execs -> stop), {total} episodes, 32 concurrent sandboxes")
    for name in isolations:
        rate = asyncio.run(episodes_per_second(name, total, 32, 3))
        print(f"  local sandbox {name:<6}  {rate:7.1f} episodes/s")

    # How the cost grows: throughput against concurrent sandboxes, and wall time against commands per episode.
    name = isolations[0]
    print(f"cost vs concurrency ({name}, {total // 2} episodes of 3 execs): "
          + "  ".join(f"{c}: {asyncio.run(episodes_per_second(name, total // 2, c, 3)):.1f}/s" for c in (1, 8, 32, 128)))
    print(f"cost vs commands per episode ({name}, 32 concurrent, {total // 2} episodes): "
          + "  ".join(f"{n}: {1e3 / asyncio.run(episodes_per_second(name, total // 2, 32, n)):.1f} ms/episode"
                      for n in (1, 3, 10)))


if __name__ == "__main__":
    main()
