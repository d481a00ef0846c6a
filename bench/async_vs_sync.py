"""Benchmark: step time of the async (and one-step-off) driver loop against the sync loop, same run.

Layouts (``--layout``):

* ``partitioned`` (default) -- what a GPU cluster looks like: rollout and training own separate
  devices. The engine and the trainer run as Ray actors (``cluster.mode=ray``, one torch thread each),
  and the CPU cores are split in two: the engine and the driver on one half, the trainer rank on the
  other (``sched_setaffinity``). In sync mode each half idles while the other works -- the waste async
  scheduling removes. On 2 cores this is one core each.
* ``shared`` -- everything in one process on all cores (``cluster.mode=inprocess``). Decoding and the
  train step then compete for the same cores, so overlap gains little: on 2 cores the ratio sits
  near 0.6-0.7 (see docs/results.md), a limit of the machine rather than of the scheduler.

Workload: arith-tools from its warm start, where every episode first waits for its "sandbox" to start
(``asyncio.sleep``, standing in for a remote sandbox or a slow tool). The wait is calibrated so a sync
step spends as long rolling out as training (rollout == train, the balanced workload at which the
ideal ratio is 0.5), and re-balanced after each repeat, since other work on the machine drifts the
train time. The calibration line prints how much of the rollout is decoding and how much is waiting.

Each repeat trains a fresh run per mode for ``--steps`` steps (the first ``--warmup`` not counted) and
takes the median step time (``time/step``: from asking for a batch to the end of the weight push);
the ratio is mode / sync within the repeat. Prints min / median / max over repeats, and JSON. With
``max_staleness=1`` up to two batches are in flight, so when rollout > train the ratio can go below
0.5.

    python bench/async_vs_sync.py                       # ~8 min on 2 cores
    python bench/async_vs_sync.py --layout shared --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from miles_agent.config import load_config
from miles_agent.envs.arith_tools.env import ArithToolsEnv, ArithToolsSession
from miles_agent.loop import Run

SANDBOX_START_S = 0.0  # set by the calibration, read by every episode


class SlowStartEnv(ArithToolsEnv):
    """arith-tools whose episodes wait ``SANDBOX_START_S`` before they start (a sandbox booting)."""

    async def open(self, task, sandbox=None):  # noqa: ANN001, ANN201
        await asyncio.sleep(SANDBOX_START_S)
        return ArithToolsSession(task)


def config(mode: str, steps: int, run_dir: str, args: argparse.Namespace):  # noqa: ANN201
    import miles_agent.envs.arith_tools as arith

    return load_config("tiny-cpu", {
        "env.name": f"{__name__}:SlowStartEnv", "model.warm_start": str(Path(arith.__file__).parent / "warmstart" / "tiny-qwen3"),
        "rollout.mode": mode, "rollout.max_staleness": 1, "rollout.partial_rollout": "keep",
        "rollout.prompts_per_step": args.prompts, "rollout.samples_per_prompt": args.samples,
        "env.max_new_tokens_per_turn": 40, "run.steps": steps, "run.progress": False,
        "run.checkpoint_every": 0, "run.run_dir": run_dir, "run.seed": 0,
        **LAYOUTS[args.layout], **dict(_split(o) for o in args.set)})


LAYOUTS = {"partitioned": {"cluster.mode": "ray", "cluster.num_engines": 1, "train.world_size": 1},
           "shared": {"cluster.mode": "inprocess"}}


def partition_cores(run: Run) -> dict[str, list[int]]:
    """Pin the engine actor and this driver to one half of the cores, the trainer rank to the other."""
    import ray

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--layout partitioned needs at least 2 CPU cores; use --layout shared")
    rollout_side, train_side = cores[: len(cores) // 2], cores[len(cores) // 2:]
    engine_pids = [w["pid"] for w in ray.get([a.where.remote() for a in run.engines[0].actors])]
    for pid in [os.getpid(), *engine_pids]:
        os.sched_setaffinity(pid, rollout_side)
    for pid in run.trainer.pids:
        os.sched_setaffinity(pid, train_side)
    return {"rollout_and_driver": rollout_side, "trainer": train_side}


def _split(override: str) -> tuple[str, object]:
    import yaml

    key, _, value = override.partition("=")
    return key, yaml.safe_load(value)


def run_mode(mode: str, steps: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        run = Run(config(mode, steps, d, args))
        before = os.sched_getaffinity(0)
        if args.layout == "partitioned":
            partition_cores(run)
        try:
            records = asyncio.run(run.train())
        finally:
            asyncio.run(_shutdown(run))
            run.trainer.close()
            os.sched_setaffinity(0, before)
    return records


async def _shutdown(run: Run) -> None:
    for e in run.engines:
        await e.shutdown()


def calibrate(args: argparse.Namespace) -> dict[str, float]:
    """Sync steps without latency: the sandbox wait that makes rollout ~= train."""
    global SANDBOX_START_S
    SANDBOX_START_S = 0.0
    records = run_mode("sync", 3, args)[1:]
    rollout = statistics.median(r["time/rollout"] for r in records)
    train = statistics.median(r["time/train"] + r["time/sync"] for r in records)
    SANDBOX_START_S = max(train - rollout, 0.0)
    return {"rollout_compute_s": rollout, "train_s": train, "sandbox_start_s": SANDBOX_START_S}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="partitioned",
                   help="partitioned: engine and trainer on separate cores (Ray actors); shared: one process")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--modes", default="async", help="compared against sync, comma-separated")
    p.add_argument("--sandbox-start", type=float, help="fixed latency in seconds instead of calibrating")
    p.add_argument("--torch-threads", type=int, help="shared layout: torch intra-op threads of the one process (default: torch's choice)")
    p.add_argument("--set", action="append", default=[], metavar="section.key=value",
                   help="extra config override for every run, e.g. algo.use_rollout_logprobs=false")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    global SANDBOX_START_S
    t0 = time.perf_counter()
    if args.sandbox_start is None:
        calib = calibrate(args)
    else:
        SANDBOX_START_S, calib = args.sandbox_start, {"sandbox_start_s": args.sandbox_start}
    print(f"layout: {args.layout}; workload: {args.prompts}x{args.samples} episodes/step, sandbox start {SANDBOX_START_S:.2f}s "
          f"(calibration: {json.dumps({k: round(v, 3) for k, v in calib.items()})})", flush=True)
    modes = [m for m in args.modes.split(",") if m]
    step_times: dict[str, list[float]] = {m: [] for m in ["sync", *modes]}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    balance: list[dict[str, float]] = []
    for rep in range(args.repeats):
        med, sync_parts = {}, {}
        for mode in ["sync", *modes]:
            records = run_mode(mode, args.steps, args)[args.warmup:]
            med[mode] = statistics.median(r["time/step"] for r in records)
            step_times[mode].append(med[mode])
            if mode == "sync":
                sync_parts = {"sandbox_start_s": SANDBOX_START_S,
                              "rollout_s": statistics.median(r["time/rollout"] for r in records),
                              "train_s": statistics.median(r["time/train"] + r["time/sync"] for r in records)}
        for m in modes:
            ratios[m].append(med[m] / med["sync"])
        balance.append(sync_parts)
        print(f"repeat {rep}: sync {med['sync']:.2f}s/step (rollout {sync_parts['rollout_s']:.2f}s, train "
              f"{sync_parts['train_s']:.2f}s), " + ", ".join(f"{m} {med[m]:.2f}s/step" for m in modes), flush=True)
        if args.sandbox_start is None:  # the load on shared cores drifts: keep rollout ~= train
            SANDBOX_START_S = max(0.0, SANDBOX_START_S + sync_parts["train_s"] - sync_parts["rollout_s"])
    result = {"workload": {**vars(args), **calib}, "sync_balance": balance, "step_time_s": step_times,
              "ratio_vs_sync": {m: {"min": min(r), "median": statistics.median(r), "max": max(r), "all": r}
                                for m, r in ratios.items()},
              "wall_s": time.perf_counter() - t0}
    for m, r in result["ratio_vs_sync"].items():
        print(f"{m}/sync step-time ratio: min {r['min']:.3f}  median {r['median']:.3f}  max {r['max']:.3f}"
              f"  (goal <= 0.55)")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
