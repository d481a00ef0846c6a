"""The Modal sandbox: one ``modal.Sandbox`` per episode, through the ``modal`` SDK (gRPC to Modal).

The sandbox's main process is ``sleep infinity`` under Modal's own ``timeout`` (our TTL): Modal terminates
it when that runs out, so a trainer that dies without stopping it leaves nothing past the TTL. Limits map
to ``memory`` (MiB), ``cpu`` and ``block_network``. Each `exec` runs ``timeout -s KILL`` inside (the image
needs coreutils); Modal's exec ``timeout`` a few seconds later is the backstop. Files go through the
sandbox filesystem API (``read_bytes`` / ``write_bytes`` / ``make_directory``).

Credentials: the Modal config (``modal token new``) or $MODAL_TOKEN_ID / $MODAL_TOKEN_SECRET. ``app_name``
(default "miles-agent") is looked up or created to own the sandboxes; a task's ``image`` is pulled with
``modal.Image.from_registry`` (default ``python:3.12-slim``).
"""

from __future__ import annotations

import math
import posixpath
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_agent.errors import require
from miles_agent.sandbox import ExecResult, SandboxError, SandboxSpec

from ._remote import TIMEOUT_EXIT_CODE, RemoteSandbox, RemoteSandboxOptions

BACKSTOP_S = 5
TAGS = {"miles-agent": "sandbox"}


@dataclass(frozen=True)
class ModalSandboxOptions(RemoteSandboxOptions):
    """``env.sandbox_options`` of the modal backend: ModalSandbox's keywords, typed (``sdk`` is for tests)."""

    app_name: str = "miles-agent"
    image: str = "python:3.12-slim"
    network: bool = False
    cpu: float | None = None


class ModalSandbox(RemoteSandbox):
    """A Modal sandbox per episode; Modal's sandbox timeout is the TTL."""

    name = "modal"
    description = "a Modal sandbox per episode (gRPC via the modal SDK); Modal's sandbox timeout is the TTL"
    auth_hint = "run `modal token new` or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
    options_type: ClassVar[type] = ModalSandboxOptions

    def __init__(self, *, app_name: str = "miles-agent", image: str = "python:3.12-slim", network: bool = False,
                 cpu: float | None = None, sdk: Any = None, **kwargs: Any) -> None:
        """``sdk``: the ``modal`` module (tests pass a double with the same API)."""
        super().__init__(**kwargs)
        self.app_name = app_name
        self.default_image = image
        self.network = network
        self.cpu = cpu
        self._sdk = sdk

    @property
    def modal(self):  # noqa: ANN201 - the modal module
        if self._sdk is None:
            self._sdk = require("modal", "modal", "the modal sandbox")
        return self._sdk

    def _classify(self, exc: BaseException) -> tuple[str | None, float | None]:
        kind, after = super()._classify(exc)
        if kind:
            return kind, after
        err = self.modal.exception
        if isinstance(exc, err.ResourceExhaustedError):
            return "rate_limit", None
        if isinstance(exc, (err.AuthError, err.PermissionDeniedError)):
            return "auth", None
        if isinstance(exc, (err.ConnectionError, err.InternalError, err.ServiceError)):
            return "transient", None
        return None, None

    def _create(self, spec: SandboxSpec) -> None:
        modal = self.modal
        app = self.call("look up app", modal.App.lookup, self.app_name, create_if_missing=True)
        image = modal.Image.from_registry(spec.image or self.default_image)
        ttl = max(1, int(math.ceil(self.ttl_s)))
        self.handle = self.call(
            "create sandbox", modal.Sandbox.create, "sleep", "infinity", app=app, image=image, timeout=ttl,
            workdir=self.workdir, env=dict(spec.env) or None, memory=max(1, spec.limits.memory_bytes >> 20),
            cpu=self.cpu, block_network=not self.network, tags=dict(TAGS))
        self.call("make workspace", self.handle.filesystem.make_directory, self.workdir, create_parents=True)

    def _exec(self, command: str, timeout_s: float, cwd: str, env: dict[str, str]) -> ExecResult:
        err = self.modal.exception
        started = time.monotonic()
        proc = self.call("exec", self.handle.exec, "timeout", "-s", "KILL", f"{max(timeout_s, 0.001):.3f}", "bash",
                         "-c", command, timeout=int(math.ceil(timeout_s)) + BACKSTOP_S, workdir=cwd,
                         env=env or None, text=False, retry=False)
        backstop = False
        try:
            code = proc.wait()
        except (err.ExecTimeoutError, err.TimeoutError):
            backstop, code = True, TIMEOUT_EXIT_CODE
        out = proc.stdout.read() if not backstop else b""
        errs = proc.stderr.read() if not backstop else b""
        duration = time.monotonic() - started
        timed_out = backstop or (code == TIMEOUT_EXIT_CODE and duration >= timeout_s * 0.95)
        return ExecResult(exit_code=code, stdout=_text(out), stderr=_text(errs), duration_s=duration,
                          timed_out=timed_out, limit_hit="wall_time" if timed_out else None)

    def _read(self, path: str) -> bytes:
        try:
            return bytes(self.handle.filesystem.read_bytes(path))
        except self.modal.exception.SandboxFilesystemNotFoundError as e:
            raise SandboxError(f"modal sandbox: {path} does not exist in the sandbox") from e

    def _write(self, path: str, content: bytes) -> None:
        self.handle.filesystem.make_directory(posixpath.dirname(path), create_parents=True)
        self.handle.filesystem.write_bytes(content, path)

    def _destroy(self, handle: Any) -> None:
        try:
            handle.terminate()
        except self.modal.exception.NotFoundError:
            pass  # already ended (its timeout ran out, or a second stop)


def _text(data: bytes | str) -> str:
    return data if isinstance(data, str) else data.decode(errors="replace")
