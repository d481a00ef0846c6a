"""`miles-agent sandbox exec` as scripts use it: its exit status is the command's, and a reader that
closes the pipe early (`... | head`) ends it quietly (issue 13, class 6). The real CLI, as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles_agent.cli import BROKEN_PIPE_EXIT, SANDBOX_TIMEOUT_EXIT

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "miles_agent.cli", "sandbox", "exec"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("code", [0, 3, 7, 255])
def test_exit_status_is_the_commands(code):
    out = run_cli("--", f"echo hi; exit {code}")
    assert out.returncode == code, out.stderr
    assert f"exit code {code}" in out.stdout


def test_a_timed_out_command_exits_124():
    out = run_cli("--timeout", "1", "--", "sleep 5")
    assert out.returncode == SANDBOX_TIMEOUT_EXIT == 124, out.stderr
    assert "timed out" in out.stdout and "limit hit: wall_time" in out.stdout


def test_a_reader_that_closes_early_gets_no_traceback():
    # More output than a pipe buffer holds (64 KiB), so the CLI is still writing when the reader leaves.
    proc = subprocess.Popen([*CLI, "--", "yes | head -c 100000000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.read(100).startswith(b"--- stdout ---\ny\ny")
    proc.stdout.close()  # as `head -c 100` does
    _, stderr = proc.communicate(timeout=120)
    assert b"Traceback" not in stderr and b"BrokenPipeError" not in stderr, stderr.decode()
    assert proc.returncode == BROKEN_PIPE_EXIT == 141


def test_the_same_through_a_shell_pipeline():
    line = f"{sys.executable} -m miles_agent.cli sandbox exec -- 'yes | head -c 100000000' | head -c 10; " \
           "echo \" status=${PIPESTATUS[0]}\" >&2"
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.stdout == "--- stdout"
    assert "Traceback" not in out.stderr and out.stderr.strip() == "status=141", out.stderr
