"""The E2B sandbox: one E2B cloud sandbox (a Firecracker microVM) per episode, through the ``e2b`` SDK.

The control plane (REST: create, kill) is retried with back-off on rate limits and transient errors. The
sandbox's E2B timeout is set to our TTL: E2B kills it on its own when it runs out, so a trainer that dies
without stopping it leaves nothing running past the TTL. Commands run through envd (Connect-RPC) wrapped in
``timeout -s KILL``; a client-side deadline a little later kills the process by pid if the wrapper did not.

Credentials: ``api_key`` or $E2B_API_KEY. ``template`` (default "base") is used when the task names no image;
a task's ``image`` is taken as an E2B template name or id. ``api_url`` / ``sandbox_url`` / ``http_version``
are passed to the SDK (tests point them at a local fake).
"""

from __future__ import annotations

import os
import shlex
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_agent.errors import require
from miles_agent.sandbox import ExecResult, SandboxError, SandboxSpec

from ._remote import TIMEOUT_EXIT_CODE, RemoteSandbox, RemoteSandboxOptions

METADATA = {"miles-agent": "sandbox"}
KILLED_BY_SIGNAL = -1
BACKSTOP_S = 5.0  # client-side slack over the in-sandbox timeout before we kill by pid


def _e2b():  # noqa: ANN202 - the module
    return require("e2b", "e2b", "the e2b sandbox")


@dataclass(frozen=True)
class E2BSandboxOptions(RemoteSandboxOptions):
    """``env.sandbox_options`` of the e2b backend: E2BSandbox's keywords, typed."""

    api_key: str | None = None
    template: str = "base"
    api_url: str | None = None
    sandbox_url: str | None = None
    http_version: str | None = None
    allow_internet_access: bool = False


class E2BSandbox(RemoteSandbox):
    """An E2B cloud sandbox per episode; E2B's sandbox timeout is the TTL."""

    name = "e2b"
    description = "an E2B cloud sandbox (microVM) per episode; E2B's sandbox timeout is the TTL"
    auth_hint = "set E2B_API_KEY to a valid key (https://e2b.dev/dashboard)"
    options_type: ClassVar[type] = E2BSandboxOptions

    def __init__(self, *, api_key: str | None = None, template: str = "base", api_url: str | None = None,
                 sandbox_url: str | None = None, http_version: str | None = None,
                 allow_internet_access: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_key = api_key or os.environ.get("E2B_API_KEY")
        self.template = template
        self.allow_internet_access = allow_internet_access
        # retries=0: the SDK's own control-plane retries are switched off so that one bounded policy
        # (ours, with jitter and a clear error at the end) governs every call.
        self._opts = {k: v for k, v in {"api_url": api_url, "sandbox_url": sandbox_url,
                                         "http_version": http_version, "retries": 0}.items() if v is not None}

    def _classify(self, exc: BaseException) -> tuple[str | None, float | None]:
        kind, after = super()._classify(exc)
        if kind:
            return kind, after
        e2b = _e2b()
        import httpx

        if isinstance(exc, e2b.RateLimitException):
            return "rate_limit", None
        if isinstance(exc, e2b.AuthenticationException):
            return "auth", None
        transient = (e2b.SandboxUnreachableException, e2b.GuestUnresponsiveException, e2b.ServiceBusyException,
                     httpx.TransportError)
        if isinstance(exc, transient) or getattr(exc, "status_code", None) in (500, 502, 503, 504):
            return "transient", None
        return None, None

    def _create(self, spec: SandboxSpec) -> None:
        if not self.api_key:
            raise SandboxError(f"e2b sandbox: no API key; {self.auth_hint}, or pass api_key=")
        e2b = _e2b()
        key = f"miles-agent-{uuid.uuid4().hex}"  # a retried create after a lost reply returns the same sandbox
        self.handle = self.call(
            "create sandbox", e2b.Sandbox.create, template=spec.image or self.template, timeout=int(self.ttl_s),
            metadata=dict(METADATA), envs=dict(spec.env), allow_internet_access=self.allow_internet_access,
            api_key=self.api_key, idempotency_key=key, **self._opts)
        # Relative to "/" rather than absolute: the same command, and the test fake can re-root it.
        made = self.call("make workspace", self.handle.commands.run, f"mkdir -p {self.workdir.lstrip('/')}", cwd="/",
                         timeout=60)
        if made.exit_code != 0:
            raise SandboxError(f"e2b sandbox: cannot create {self.workdir}: {made.stderr.strip()}")

    def _exec(self, command: str, timeout_s: float, cwd: str, env: dict[str, str]) -> ExecResult:
        e2b = _e2b()
        wrapped = f"timeout -s KILL {max(timeout_s, 0.001):.3f} bash -c {shlex.quote(command)}"
        started = time.monotonic()
        proc = self.call("exec", self.handle.commands.run, wrapped, background=True, envs=env, cwd=cwd,
                         timeout=timeout_s + BACKSTOP_S)
        backstop = False
        try:
            result = proc.wait()
            code, out, err = result.exit_code, result.stdout, result.stderr
        except e2b.CommandExitException as e:
            code, out, err = e.exit_code, e.stdout, e.stderr
        except e2b.TimeoutException:
            proc.kill()
            backstop = True
            code, out, err = TIMEOUT_EXIT_CODE, proc.stdout, proc.stderr
        duration = time.monotonic() - started
        # envd reports a process ended by a signal as exit code -1 (bash may report 137 instead).
        killed = code in (TIMEOUT_EXIT_CODE, KILLED_BY_SIGNAL)
        timed_out = backstop or (killed and duration >= timeout_s * 0.95)
        return ExecResult(exit_code=TIMEOUT_EXIT_CODE if timed_out else code, stdout=out, stderr=err, duration_s=duration, timed_out=timed_out,
                          limit_hit="wall_time" if timed_out else None)

    def _read(self, path: str) -> bytes:
        e2b = _e2b()
        try:
            return bytes(self.handle.files.read(path, format="bytes"))
        except (e2b.FileNotFoundException, e2b.NotFoundException) as e:
            raise SandboxError(f"e2b sandbox: {path} does not exist in the sandbox") from e

    def _write(self, path: str, content: bytes) -> None:
        self.handle.files.write(path, content, use_octet_stream=True)

    def _destroy(self, handle: Any) -> None:
        handle.kill()  # False (not an error) when E2B already ended it
