"""Launch and supervise SGLang servers as subprocesses (``python -m sglang.launch_server ...``).

`SGLangServer` owns one server process: argv from a plain dict of SGLang server arguments (any argument
passes through verbatim: ``{"tp_size": 2}`` -> ``--tp-size 2``), its own process group (so TP workers die
with it), a log file, readiness by ``/health_generate``, restart when it died. In one process the driver
owns the servers; under ``cluster.mode=ray`` each is owned by an actor in its engine bundle
(runtime/sglang_actor.py), with no change to the client.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError

DEFAULT_LAUNCH = f"{shlex.quote(sys.executable)} -m sglang.launch_server"


def server_argv(launch: str, model_path: str, host: str, port: int, server_args: dict[str, Any]) -> list[str]:
    """The command line: ``launch`` then ``--model-path/--host/--port`` then every server argument.

    ``key: true`` -> ``--key``; ``false`` / None -> omitted; a list -> ``--key a b``; dicts -> JSON."""
    import json

    argv = [*shlex.split(launch), "--model-path", model_path, "--host", host, "--port", str(port)]
    for key, value in server_args.items():
        flag = "--" + str(key).replace("_", "-")
        if flag in ("--model-path", "--host", "--port"):
            raise UserError(f"sglang.server_args.{key} is set by miles-agent (model.hf_checkpoint, "
                            "sglang.host, sglang.base_port); remove it from server_args")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


class SGLangServer:
    """One supervised SGLang server process (see module docstring)."""

    def __init__(self, argv: list[str], url: str, log_path: str | Path, *, env: dict[str, str] | None = None,
                 max_restarts: int = 2) -> None:
        self.argv, self.url = argv, url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = env
        self.max_restarts = max_restarts
        self.restarts = 0
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, **(self.env or {})})

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/health_generate`` answers 200; raise naming the log when it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = None if self._proc is None else self._proc.returncode
                raise RuntimeError(f"SGLang server for {self.url} exited with code {code} while starting; "
                                   f"its log ({self.log_path}) ends with:\n{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SGLang server for {self.url} was not healthy within {timeout_s:.0f}s "
                           f"(sglang.startup_timeout_s); its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def ensure_running(self, timeout_s: float) -> bool:
        """Restart a dead server (up to ``max_restarts`` times); True when it had to."""
        if self.alive():
            return False
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"SGLang server for {self.url} died {self.restarts + 1} times; giving up. "
                               f"Its log ({self.log_path}) ends with:\n{self.log_tail()}")
        self.restarts += 1
        self.start()
        self.wait_ready(timeout_s)
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"
