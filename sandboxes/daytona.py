"""The Daytona sandbox: one Daytona sandbox per episode, through the ``daytona`` SDK (REST control plane and
the toolbox API of the sandbox).

TTL: Daytona counts in minutes. The sandbox is created with ``ttl_minutes`` (a hard lifetime),
``auto_stop_interval`` (stop after that long idle) and ``auto_delete_interval=0`` (delete as soon as it
stops), each ceil(ttl_s / 60): a trainer that dies without stopping it leaves nothing past the TTL.

The toolbox's ``process/execute`` returns stdout and stderr interleaved, so each command runs in a small
wrapper that sends them to two temp files and prints the exit code and both streams base64-encoded; the
wrapper also applies ``timeout -s KILL`` (the image needs bash, coreutils and base64). Reading a file goes
through the same execute call (base64); writing uses the toolbox upload.

Credentials: ``api_key`` or $DAYTONA_API_KEY; ``api_url`` or $DAYTONA_API_URL (default: Daytona's cloud);
``target`` or $DAYTONA_TARGET. ``image`` (task) or ``snapshot`` (option) selects what runs.
"""

from __future__ import annotations

import base64
import math
import os
import shlex
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_agent.errors import require
from miles_agent.sandbox import ExecResult, SandboxError, SandboxSpec

from ._remote import TIMEOUT_EXIT_CODE, RemoteSandbox, RemoteSandboxOptions

LABELS = {"miles-agent": "sandbox"}
BACKSTOP_S = 5
FRAME = "@@miles-agent-exec@@"


def _daytona():  # noqa: ANN202 - the module
    return require("daytona", "daytona", "the daytona sandbox")


def wrap(command: str, timeout_s: float) -> str:
    """The command under ``timeout -s KILL`` with stdout/stderr/exit code framed for one execute call."""
    inner = f"timeout -s KILL {max(timeout_s, 0.001):.3f} bash -c {shlex.quote(command)}"
    return (f'd=$(mktemp -d) && {{ {inner} >"$d/o" 2>"$d/e" </dev/null; rc=$?; printf "\\n{FRAME}%s\\n" "$rc"; '
            'base64 -w0 "$d/o"; printf "\\n"; base64 -w0 "$d/e"; printf "\\n"; rm -rf "$d"; }')


def unwrap(output: str) -> tuple[int, str, str]:
    # The shell's own notices (e.g. "Killed") share the stream: the frame starts after the last marker.
    lines = output.rpartition(FRAME)[2].split("\n")
    if len(lines) < 3 or not lines[0].strip().lstrip("-").isdigit():
        raise SandboxError(f"daytona sandbox: the command wrapper failed (is bash/base64 in the image?): "
                           f"{output[:500]!r}")
    code = int(lines[0])
    out, err = (base64.b64decode(x).decode(errors="replace") for x in lines[1:3])
    return code, out, err


@dataclass(frozen=True)
class DaytonaSandboxOptions(RemoteSandboxOptions):
    """``env.sandbox_options`` of the daytona backend: DaytonaSandbox's keywords, typed."""

    api_key: str | None = None
    api_url: str | None = None
    target: str | None = None
    snapshot: str | None = None
    network: bool = False


class DaytonaSandbox(RemoteSandbox):
    """A Daytona sandbox per episode; ttl_minutes / auto-stop / auto-delete are the TTL."""

    name = "daytona"
    description = "a Daytona cloud sandbox per episode; ttl_minutes + auto-stop/auto-delete are the TTL"
    auth_hint = "set DAYTONA_API_KEY to a valid key (and DAYTONA_API_URL for a self-hosted Daytona)"
    options_type: ClassVar[type] = DaytonaSandboxOptions

    def __init__(self, *, api_key: str | None = None, api_url: str | None = None, target: str | None = None,
                 snapshot: str | None = None, network: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_key = api_key or os.environ.get("DAYTONA_API_KEY")
        self.api_url = api_url or os.environ.get("DAYTONA_API_URL")
        self.target = target or os.environ.get("DAYTONA_TARGET")
        self.snapshot = snapshot
        self.network = network
        self.client: Any = None

    def _classify(self, exc: BaseException) -> tuple[str | None, float | None]:
        kind, after = super()._classify(exc)
        if kind:
            return kind, after
        daytona = _daytona()
        import httpx

        if isinstance(exc, getattr(daytona, "DaytonaRateLimitError", ())):
            return "rate_limit", None
        code = getattr(exc, "status_code", None)
        if code == 429:
            return "rate_limit", None
        if code in (401, 403) or isinstance(exc, getattr(daytona, "DaytonaAuthenticationError", ())):
            return "auth", None
        if code in (500, 502, 503, 504) or isinstance(exc, (httpx.TransportError, ConnectionError)):
            return "transient", None
        return None, None

    def _connect(self):  # noqa: ANN202 - daytona.Daytona
        if not self.api_key:
            raise SandboxError(f"daytona sandbox: no API key; {self.auth_hint}, or pass api_key=")
        daytona = _daytona()
        config = daytona.DaytonaConfig(api_key=self.api_key, api_url=self.api_url, target=self.target)
        return daytona.Daytona(config)

    def _create(self, spec: SandboxSpec) -> None:
        daytona = _daytona()
        self.client = self._connect()
        minutes = max(1, math.ceil(self.ttl_s / 60))
        name = f"miles-agent-{uuid.uuid4().hex[:16]}"
        common = dict(name=name, env_vars=dict(spec.env), labels=dict(LABELS),
                      auto_stop_interval=minutes, auto_delete_interval=0, ttl_minutes=minutes,
                      network_block_all=not self.network, language="python")
        if spec.image:
            params = daytona.CreateSandboxFromImageParams(image=spec.image, **common)
        else:
            params = daytona.CreateSandboxFromSnapshotParams(snapshot=self.snapshot, **common)
        try:
            self.handle = self.call("create sandbox", self.client.create, params, timeout=120)
        except BaseException:
            self._adopt(name)  # created, but the reply was lost or the wait for it failed: remove it too
            raise
        self.call("make workspace", self.handle.process.exec, f"mkdir -p {self.workdir.lstrip('/')}", cwd="/",
                  timeout=60)

    def _adopt(self, name: str) -> None:
        try:
            self.handle = self.client.get(name)
        except Exception:  # noqa: BLE001 - never created, or unreachable: the TTL is the backstop
            pass

    def _exec(self, command: str, timeout_s: float, cwd: str, env: dict[str, str]) -> ExecResult:
        started = time.monotonic()
        response = self.handle.process.exec(wrap(command, timeout_s), cwd=cwd, env=env or None,
                                            timeout=int(math.ceil(timeout_s)) + BACKSTOP_S)
        duration = time.monotonic() - started
        code, out, err = unwrap(response.result or "")
        timed_out = code == TIMEOUT_EXIT_CODE and duration >= timeout_s * 0.95
        return ExecResult(exit_code=code, stdout=out, stderr=err, duration_s=duration, timed_out=timed_out,
                          limit_hit="wall_time" if timed_out else None)

    def _read(self, path: str) -> bytes:
        q = shlex.quote(path.lstrip("/"))  # relative to cwd "/": the same file, and a test fake can re-root it
        response = self.handle.process.exec(f"if [ -f {q} ]; then base64 -w0 {q}; else echo MISSING; fi",
                                            cwd="/", timeout=120)
        text = (response.result or "").strip()
        if response.exit_code != 0 or text == "MISSING":
            raise SandboxError(f"daytona sandbox: {path} does not exist in the sandbox")
        return base64.b64decode(text)

    def _write(self, path: str, content: bytes) -> None:
        self.handle.fs.upload_file(content, path)

    def _destroy(self, handle: Any) -> None:
        daytona = _daytona()
        try:
            handle.delete()
        except daytona.DaytonaNotFoundError:
            pass  # already deleted (its TTL ran out, or a second stop)
