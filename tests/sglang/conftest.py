"""Fake SGLang servers (tests/sglang/fake_sglang_server.py) started as real processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

FAKE = Path(__file__).with_name("fake_sglang_server.py")


class FakeServer:
    def __init__(self, model: str, *args: str, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(FAKE), "--model-path", model, "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=open(log, "wb"), start_new_session=True, text=True)
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY") or not line:
                break
        if not line.startswith("READY"):
            self.kill()
            raise RuntimeError(f"fake SGLang server did not start: {log.read_text()[-2000:]}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/_fake/state", timeout=10) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        """SIGKILL: the engine dies with no goodbye, as a crashed server would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="session")
def start_fake(tmp_path_factory):
    servers: list[FakeServer] = []

    def start(model: str = "tiny-qwen3", *args: str) -> FakeServer:
        s = FakeServer(model, *args, log=tmp_path_factory.mktemp("fake") / "server.log")
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.kill()


@pytest.fixture(scope="session")
def dense_server(start_fake):
    """tiny-qwen3 (seed 0) whose weights no test changes; each scheduler step is slowed by 20 ms so
    requests can be caught in flight."""
    return start_fake("tiny-qwen3", "--decode-delay-s", "0.02", "--ignore-eos")


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
