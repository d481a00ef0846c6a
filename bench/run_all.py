"""The benchmark suite: every speed figure of the project as a ratio against a baseline measured in
the same run, with min / median / max over repeats, printed and written as JSON with machine info.

| bench | ours | baseline |
|---|---|---|
| engine_vs_hf | embedded EmbeddedEngine, multi-turn workload | HF ``generate`` (padded batch; one at a time) |
| trainer_vs_trl | FSDP2 trainer tokens/s | TRL GRPOTrainer loss/backward/step, same batch |
| sandbox_overhead | bubblewrap sandbox exec latency | bare subprocess (ratio = cost multiple) |
| weight_sync | bench/weight_sync.py (if present) | its own raw copy / broadcast baseline |
| async_vs_sync | bench/async_vs_sync.py (if present) | its own synchronous loop |
| weight_sync_ray | bench/weight_sync_ray.py (if present): the two weight paths under Ray | raw actor-to-actor put/get, gloo broadcast |
| e2e_vs_trl | time to a target reward on arith-tools | TRL GRPOTrainer, single-turn |

    python bench/run_all.py                     # the full suite (tens of minutes on 2 CPU cores)
    python bench/run_all.py --quick             # seconds per bench: proves the suite runs (CI)
    python bench/run_all.py --only engine_vs_hf,sandbox_overhead --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent


def load_bench(name: str) -> Any:
    """Import ``bench/NAME.py`` as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the benches ---------------------------------------------------------------------------------------

def engine_vs_hf(quick: bool, repeats: int) -> dict[str, Any]:
    import copy

    import torch

    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    m = load_bench("engine_vs_hf")
    episodes, seq_episodes, turns, new, plen = (8, 2, 1, 8, 32) if quick else (32, 8, 2, 64, 100)
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen3")
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=episodes)
    engine.eos_ids = frozenset()  # equal work: every request samples exactly `new` tokens
    prompts = m.make_prompts(episodes, plen, seed=0)
    m.run_engine(engine, m.make_prompts(2, 8, seed=1), 1, 2)  # warm-up
    batched, one_by_one, rates = [], [], []
    for _ in range(repeats):
        eng = _rate(m.run_engine, engine, prompts, turns, new)
        hf_b = _rate(m.run_hf_batched, model, prompts, turns, new)
        hf_s = _rate(m.run_hf_sequential, model, prompts[:seq_episodes], turns, new)
        batched.append(eng / hf_b)
        one_by_one.append(eng / hf_s)
        rates.append({"engine_tok_s": eng, "hf_batched_tok_s": hf_b, "hf_one_at_a_time_tok_s": hf_s})
    return {"ratios": {"engine / HF generate (padded batch), tokens/s": batched,
                       "engine / HF generate (one request at a time), tokens/s": one_by_one},
            "detail": {"workload": f"{episodes} episodes x {turns} turns, ~{plen}-token prompts, {new} new tokens",
                       "per_repeat": rates}}


def _rate(fn: Callable[..., int], *args: Any) -> float:
    t = time.perf_counter()
    tokens = fn(*args)
    return tokens / (time.perf_counter() - t)


def trainer_vs_trl(quick: bool, repeats: int) -> dict[str, Any]:
    m = load_bench("trainer_vs_trl")
    return m.measure(repeats, 1, 8, 16, 16) if quick else m.measure(repeats)


def sandbox_overhead(quick: bool, repeats: int) -> dict[str, Any]:
    m = load_bench("sandbox_overhead")
    isolations = (["bwrap"] if shutil.which("bwrap") else []) + ["none"]
    iters = 10 if quick else 200
    ratios: dict[str, list[float]] = {f"sandbox ({i}) / bare subprocess, exec p50 latency": [] for i in isolations}
    p50s = []
    for _ in range(repeats):
        times = asyncio.run(m.exec_latency(iters, isolations))
        bare = statistics.median(times["bare"])
        p50s.append({k: statistics.median(v) * 1e3 for k, v in times.items()})
        for i in isolations:
            ratios[f"sandbox ({i}) / bare subprocess, exec p50 latency"].append(statistics.median(times[i]) / bare)
    return {"ratios": ratios, "detail": {"command": "true", "iters": iters, "p50_ms_per_repeat": p50s,
                                         "note": "a cost multiple: lower is better"}}


def e2e_vs_trl(quick: bool, repeats: int) -> dict[str, Any]:
    return load_bench("e2e_vs_trl").measure(quick=quick)


_RATIO = re.compile(r"(\d+(?:\.\d+)?)\s*[x×]\b")


def _weight_sync_ratios(data: dict[str, Any]) -> dict[str, list[float]]:
    """bench/weight_sync.py JSON: per transport, raw-baseline time / transport time per repeat."""
    short = {"shm": "raw shared-memory copy", "distributed": "raw gloo broadcast", "disk": "raw safetensors save+load"}
    return {f"weight sync {kind}: bandwidth / {short.get(kind, 'raw baseline')}":
            [raw / t for t, raw in zip(r["seconds"], r["raw_seconds"])] for kind, r in data["results"].items()}


def _async_ratios(data: dict[str, Any]) -> dict[str, list[float]]:
    """bench/async_vs_sync.py JSON: its mode/sync step-time ratios, inverted into speedups."""
    return {f"step time: sync / {mode} (speedup)": [1.0 / v for v in r["all"]]
            for mode, r in data["ratio_vs_sync"].items()}


def _ray_sync_ratios(data: dict[str, Any]) -> dict[str, list[float]]:
    """bench/weight_sync_ray.py JSON: per Ray path, path bandwidth / raw actor-to-actor baseline."""
    return {f"weight sync under Ray, {label}": r["all"] for label, r in data["ratios"].items()}


# How to run another part's bench: arguments (quick, full given repeats) and how to read its JSON.
EXTERNAL: dict[str, tuple[list[str], Callable[[int], list[str]], Callable[[dict[str, Any]], dict[str, list[float]]]]] = {
    "weight_sync": (["--quick"], lambda n: ["--repeat", str(n)], _weight_sync_ratios),
    "async_vs_sync": (["--repeats", "1", "--steps", "2", "--warmup", "1", "--prompts", "2", "--samples", "2"],
                      lambda n: ["--repeats", str(n)], _async_ratios),
    "weight_sync_ray": (["--quick"], lambda n: ["--repeats", str(n)], _ray_sync_ratios),
}


def _supported(source: str, args: list[str]) -> list[str]:
    """Keep only the flags (and their values) the script's source mentions, so a changed CLI degrades."""
    out, i = [], 0
    while i < len(args):
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if f'"{args[i]}"' in source:
            out += args[i:i + 1 + takes_value]
        i += 1 + takes_value
    return out


def external(name: str) -> Callable[[bool, int], dict[str, Any]]:
    """A bench another part of the project owns: run ``bench/NAME.py`` if it exists (its own repeats),
    read its ``--json`` output, else the ratios (``1.23x``) off its stdout, one label per line."""

    def run(quick: bool, repeats: int) -> dict[str, Any]:
        import tempfile

        script = BENCH_DIR / f"{name}.py"
        if not script.is_file():
            return {"status": "not available", "ratios": {}, "detail": {"note": f"bench/{name}.py is not in this checkout"}}
        quick_args, full_args, parse = EXTERNAL.get(name, (["--quick"], lambda n: [], None))
        source = script.read_text()
        with tempfile.TemporaryDirectory() as d:
            out_json = Path(d) / "out.json"
            args = _supported(source, [*(quick_args if quick else full_args(repeats)), "--json", str(out_json)])
            proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=600 if quick else 3600)
            if proc.returncode != 0:
                raise RuntimeError(f"bench/{name}.py exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
            ratios: dict[str, list[float]] = {}
            if parse is not None and out_json.is_file():
                try:
                    ratios = parse(json.loads(out_json.read_text()))
                except (KeyError, TypeError, ValueError, ZeroDivisionError):
                    ratios = {}
        if not ratios:
            for line in proc.stdout.splitlines():
                found = _RATIO.findall(line)
                if found:
                    label = re.sub(r"\s+", " ", _RATIO.sub("", line)).strip(" :|-")
                    ratios.setdefault(label or name, []).append(float(found[-1]))
        if not ratios:
            raise RuntimeError(f"bench/{name}.py printed no ratio this suite can read: {proc.stdout.strip()[-300:]}")
        return {"ratios": ratios, "detail": {"args": args[:-2], "stdout": proc.stdout[-4000:]}}

    return run


BENCHES: dict[str, Callable[[bool, int], dict[str, Any]]] = {
    "engine_vs_hf": engine_vs_hf,
    "trainer_vs_trl": trainer_vs_trl,
    "sandbox_overhead": sandbox_overhead,
    "weight_sync": external("weight_sync"),
    "async_vs_sync": external("async_vs_sync"),
    "weight_sync_ray": external("weight_sync_ray"),
    "e2e_vs_trl": e2e_vs_trl,
}
# e2e runs a whole training to a target on each side: one repeat unless asked otherwise.
SINGLE_REPEAT = {"e2e_vs_trl"}


# -- the suite -------------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    mem = ""
    if Path("/proc/meminfo").is_file():
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
                            "cpus": os.cpu_count(), "memory": mem, "loadavg_start": os.getloadavg(),
                            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def summarize(values: list[float]) -> dict[str, Any]:
    finite = [v for v in values if v == v]
    if not finite:
        return {"values": values, "min": None, "median": None, "max": None}
    return {"values": values, "min": min(finite), "median": statistics.median(finite), "max": max(finite)}


def run_suite(names: list[str], quick: bool, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        t = time.perf_counter()
        print(f"[{name}] running ...", flush=True)
        try:
            out = BENCHES[name](quick, 1 if name in SINGLE_REPEAT else repeats)
            status = out.pop("status", "ok")
        except Exception as e:  # noqa: BLE001 - one broken bench must not hide the others' figures
            traceback.print_exc()
            out, status = {"ratios": {}, "detail": {}}, f"error: {type(e).__name__}: {e}"
        results[name] = {"status": status, "seconds": time.perf_counter() - t,
                         "ratios": {k: summarize(v) for k, v in out["ratios"].items()}, "detail": out["detail"]}
    return results


def print_table(results: dict[str, Any]) -> None:
    print("\nratio (higher = ours faster unless noted)                               median     min     max   n")
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"  {name}: {r['status']}")
            continue
        for label, s in r["ratios"].items():
            if s["median"] is None:
                print(f"  {label:<70s}     n/a")
                continue
            print(f"  {label:<70s} {s['median']:6.2f}x {s['min']:6.2f}x {s['max']:6.2f}x {len(s['values']):3d}")
        note = r["detail"].get("note") if isinstance(r["detail"], dict) else None
        if note:
            print(f"    note: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads, 1 repeat: proves every bench runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHES)}")
    ap.add_argument("--json", default="bench/results.json", help="where to write the JSON (default %(default)s)")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.only.split(",")] if a.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown bench {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    import torch

    torch.set_num_threads(1)  # stable figures on shared cores (see bench/engine_vs_hf.py --threads)
    info = machine_info()
    results = run_suite(names, a.quick, 1 if a.quick else a.repeats)
    info["loadavg_end"] = os.getloadavg()
    print_table(results)
    report = {"command": " ".join(["python bench/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
              "quick": a.quick, "machine": info, "results": results}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2, default=str))
    print(f"\nJSON written to {a.json}; load average {info['loadavg_start'][0]:.1f} at start, "
          f"{info['loadavg_end'][0]:.1f} at end on {info['cpus']} CPUs")
    return 0 if all(r["status"] in ("ok", "not available") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
