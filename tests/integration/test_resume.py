"""--resume continues a run from its latest checkpoint: a run SIGKILLed after a checkpoint and resumed
logs exactly the metrics (timings aside) of a run that was never interrupted, in sync and one-step-off
mode -- same weights, optimizer, data position, sampling seeds and buffered batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.loop import Run, train

SMALL = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
         "env.max_new_tokens_per_turn": 8, "run.progress": False, "run.checkpoint_every": 1}

# The warm start plays real multi-turn episodes; a hot temperature and an entropy bonus make every step
# move the weights, so a resume that lost any state would show in the next steps' numbers.
LIVE = {"rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.temperature": 1.3,
        "env.max_new_tokens_per_turn": 32, "algo.entropy_coef": 0.01, "run.progress": False,
        "run.checkpoint_every": 1}


def test_resume_continues_where_the_checkpoint_left_off(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.steps": 2, "run.run_dir": str(tmp_path)})
    train(cfg)
    more = load_config("tiny-cpu", {**SMALL, "run.steps": 3, "run.run_dir": str(tmp_path)})
    run = Run(more, resume=True)
    assert run.step == 2 and run.sampler.position == 2 * 2
    run.trainer.close()
    records = train(more, resume=True)
    assert [r["step"] for r in records] == [2]
    assert records[0]["weight_version"] == 2  # the engine got the checkpoint's weights before sampling
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.run_dir": str(tmp_path)})
    with pytest.raises(UserError, match="no checkpoint in"):
        Run(cfg, resume=True)


def test_resume_in_another_mode_is_a_clear_error(tmp_path):
    train(load_config("tiny-cpu", {**SMALL, "run.steps": 1, "run.run_dir": str(tmp_path)}))
    other = load_config("tiny-cpu", {**SMALL, "run.steps": 2, "run.run_dir": str(tmp_path),
                                     "rollout.mode": "one_step_off"})
    with pytest.raises(UserError, match="rollout.mode=sync"):
        Run(other, resume=True)


def _without_timings(record: dict) -> str:
    kept = {k: v for k, v in record.items() if not k.startswith("time/") and k != "rollout_tokens_per_s"}
    return json.dumps(kept, sort_keys=True)  # NaN compares equal as text


# One intra-op thread everywhere: float reductions then do not depend on the thread count, nor on what
# earlier tests in this process did to torch's thread pool (switching 1 -> 2 threads changes the last bits).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cli(run_dir, overrides: dict, steps: int, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "miles_agent.cli", "train", "--env", "arith-tools", "--recipe", "tiny-cpu",
           "--run-dir", str(run_dir), "--steps", str(steps), "--no-progress", *(["--resume"] if resume else []),
           *(f"{k}={v}" for k, v in overrides.items())]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ONE_THREAD})


def _kill_after_first_checkpoint(run_dir, overrides: dict) -> int:
    """Start `miles-agent train` in a subprocess, SIGKILL it once a checkpoint exists; the checkpoint's step."""
    proc = _cli(run_dir, overrides, steps=40)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.is_file():
        if proc.poll() is not None:
            pytest.fail(f"the training subprocess exited with {proc.returncode} before a checkpoint:\n"
                        f"{proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return int(latest.read_text().strip().removeprefix("step_"))


def _log(run_dir) -> list[str]:
    return [_without_timings(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_run_crashing_after_a_checkpoint_resumes_exactly(tmp_path, mode, one_thread, monkeypatch):
    """The quick in-process version (CI): a crash injected right after the step-1 checkpoint."""
    overrides = {**SMALL, "algo.entropy_coef": 0.01, "rollout.mode": mode}  # entropy: every step moves weights
    save = Run.save_checkpoint

    def save_then_crash(run):
        save(run)
        raise RuntimeError("injected crash")

    monkeypatch.setattr(Run, "save_checkpoint", save_then_crash)
    with pytest.raises(RuntimeError, match="injected crash"):
        train(load_config("tiny-cpu", {**overrides, "run.steps": 4, "run.run_dir": str(tmp_path / "a")}))
    monkeypatch.setattr(Run, "save_checkpoint", save)
    resumed = train(load_config("tiny-cpu", {**overrides, "run.steps": 4, "run.run_dir": str(tmp_path / "a")}),
                    resume=True)
    uninterrupted = train(load_config("tiny-cpu", {**overrides, "run.steps": 4, "run.run_dir": str(tmp_path / "b")}))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [_without_timings(r) for r in resumed] == [_without_timings(r) for r in uninterrupted[1:]]
    assert all(r["train/grad_norm"] > 0 for r in resumed)


@pytest.mark.slow  # three `miles-agent train` processes: about a minute each on 2 shared cores
@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_sigkilled_run_resumes_exactly(tmp_path, mode, one_thread):
    overrides = {**LIVE, "rollout.mode": mode}
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    step = _kill_after_first_checkpoint(killed, overrides)
    resume = _cli(killed, overrides, steps=step + 3, resume=True)  # `miles-agent train --resume`
    _, err = resume.communicate(timeout=300)
    assert resume.returncode == 0, err[-2000:]

    uninterrupted = train(load_config("tiny-cpu", {**overrides, "run.steps": step + 3,
                                                   "run.run_dir": str(reference)}))
    resumed = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()][step:]
    assert [r["step"] for r in resumed] == [step, step + 1, step + 2]
    assert [_without_timings(r) for r in resumed] == [_without_timings(r) for r in uninterrupted[step:]]
    # The whole log, including the steps the killed process wrote, reads like the uninterrupted run's.
    assert _log(killed) == _log(reference)
    assert all(r["train/grad_norm"] > 0 and r["sampled_tokens"] > 0 for r in resumed)
    if mode == "one_step_off":
        assert all(r["staleness/max"] == 1.0 for r in uninterrupted[1:])
