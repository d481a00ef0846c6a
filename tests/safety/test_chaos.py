"""Chaos: a 20-step sync run SIGKILLed at 10 random points (mid-rollout, mid-train, mid-checkpoint,
mid-write) and resumed each time ends with exactly the metrics of an uninterrupted run: every step
logged once, in order, with the same values (wall-clock timings aside). Deterministic given SEED: the
kill points are drawn from it (after K logged steps, then a delay), and the run's own RNG is restored
from each checkpoint. Nightly (about 4 minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SEED = 23
STEPS, KILLS = 20, 10
ARGS = ["--env", "arith-tools", "--no-progress", "--seed", "0", f"run.steps={STEPS}", "run.checkpoint_every=1",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]
VOLATILE = ("time/", "rollout_tokens_per_s")  # wall-clock measurements, different in every run


def _start(run_dir: Path, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "miles_agent.cli", "train", "--run-dir", str(run_dir), *(["--resume"] * resume), *ARGS]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    log = (run_dir.parent / f"{run_dir.name}.log").open("a")  # a file: a pipe nobody reads could block the run
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def _finish(proc: subprocess.Popen, run_dir: Path) -> None:
    proc.wait(timeout=900)
    assert proc.returncode == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]


def chaos_run(run_dir: Path, seed: int = SEED, kills: int = KILLS) -> list[tuple[int, float]]:
    """Start, SIGKILL at ``kills`` points drawn from ``seed``, resume each time, then run to the end."""
    rng = random.Random(seed)
    points = sorted(rng.sample(range(STEPS), kills))  # kill once this many steps are logged (then a delay)
    done = []
    for after in points:
        proc = _start(run_dir, resume=(run_dir / "config.json").is_file())  # as a user would, once a run is there
        delay = rng.uniform(0.0, 1.2)  # a step takes about a second: any phase of it
        deadline = time.monotonic() + 300
        while _logged(run_dir) < after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        done.append((after, round(delay, 3)))
    _finish(_start(run_dir, resume=True), run_dir)
    return done


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_killed_ten_times_ends_with_the_metrics_of_an_uninterrupted_one(tmp_path):
    _finish(_start(tmp_path / "clean", resume=False), tmp_path / "clean")
    points = chaos_run(tmp_path / "chaos")
    clean, chaos = _records(tmp_path / "clean"), _records(tmp_path / "chaos")
    assert [r["step"] for r in chaos] == list(range(STEPS)), points  # nothing lost, nothing duplicated
    for a, b in zip(clean, chaos):
        assert _stable(a) == _stable(b), (a["step"], points)
    assert (tmp_path / "chaos" / "final" / "model.safetensors").is_file()
    samples = [json.loads(line)["step"] for line in (tmp_path / "chaos" / "samples.jsonl").read_text().splitlines()]
    assert samples == sorted(samples) and set(samples) == set(range(STEPS))
