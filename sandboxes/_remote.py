"""What every container / cloud sandbox shares: bounded retries with back-off, cleanup on every exit path,
a time-to-live, output caps and workspace paths.

A backend subclasses `RemoteSandbox` and implements four *synchronous* hooks over its SDK (``_create``,
``_exec``, ``_read``/``_write``, ``_destroy``); they run in worker threads so many episodes share one event
loop, and so that the same ``_destroy`` can run from ``atexit`` when the process ends with sandboxes still
up. ``_classify`` maps an SDK exception to "rate_limit" / "transient" (retried with exponential back-off and
full jitter, bounded), "auth" (a SandboxError naming the env var / setting to fix) or None (raised as is,
wrapped in SandboxError).

Cleanup paths covered here, so no backend can forget one: a start that fails half-way (the backend records
its handle as soon as the service returns one; start destroys it), a start cancelled while the create call is
in flight (the call is awaited to its end and what it created is destroyed), an exception or cancellation in
the episode (``async with`` / the runner calls `stop`), `stop` itself cancelled (the destroy runs shielded),
and interpreter exit (``atexit``). The TTL given to the service is the dead-man switch for a killed process.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import posixpath
import random
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from miles_agent.sandbox import ExecResult, Sandbox, SandboxError, SandboxSpec

log = logging.getLogger(__name__)
T = TypeVar("T")
WORKDIR = "/workspace"
DEFAULT_TTL_S = 3600.0
TIMEOUT_EXIT_CODE = 137  # what `timeout -s KILL` (and a SIGKILLed shell) report


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off with full jitter: attempt k waits uniform(0, min(max, base * 2**k)), or the
    service's Retry-After when it gives one (capped by ``max_delay_s``)."""

    attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0

    def delay(self, attempt: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        if retry_after is not None and retry_after >= 0:
            return min(retry_after, self.max_delay_s)
        cap = min(self.max_delay_s, self.base_delay_s * (2 ** attempt))
        return (rng or random).uniform(0, cap)


@dataclass(frozen=True)
class RemoteSandboxOptions:
    """The options every remote backend takes (its own options dataclass extends this one)."""

    ttl_s: float | None = None
    retry: RetryPolicy | None = None  # from the config as a mapping: {"attempts": 3}


class RetryableError(Exception):
    """Raised by a backend hook to ask for a retry (``kind``: "rate_limit" or "transient")."""

    def __init__(self, message: str, kind: str = "transient", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """Keep the head and tail of an over-long output (UTF-8 bytes), with a marker in between."""
    data = text.encode(errors="replace")
    if len(data) <= limit:
        return text, False
    half = max(limit // 2, 0)
    head = data[:half].decode(errors="ignore")
    tail = data[len(data) - half:].decode(errors="ignore") if half else ""
    return f"{head}\n[... {len(data) - 2 * half} bytes dropped ...]\n{tail}", True


def workspace_path(path: str, workdir: str = WORKDIR) -> str:
    """A path relative to ``workdir`` (the sandbox's default cwd), or absolute, as an absolute path."""
    if not path:
        raise SandboxError("empty path")
    return posixpath.normpath(posixpath.join(workdir, path))


# -- process-exit cleanup -------------------------------------------------------------------------

_live: dict[int, RemoteSandbox] = {}
_live_lock = threading.Lock()


def _cleanup_at_exit() -> None:
    with _live_lock:
        left = list(_live.values())
    for sb in left:
        try:
            sb._destroy_now(retry=False)
        except Exception as e:  # noqa: BLE001 - best effort at exit; the TTL is the backstop
            log.warning("%s sandbox %s not removed at exit (%s); its TTL will end it", sb.name, sb.handle_id, e)


atexit.register(_cleanup_at_exit)


def live_sandboxes() -> list[RemoteSandbox]:
    """Sandboxes of this process that are started and not yet stopped (tests use it to prove cleanup)."""
    with _live_lock:
        return list(_live.values())


class RemoteSandbox(Sandbox):
    """Lifecycle, retries and cleanup for sandboxes that live in a container engine or a cloud service."""

    name = "remote"
    auth_hint = ""  # what to set when the service refuses our credentials

    def __init__(self, *, ttl_s: float | None = None, retry: RetryPolicy | None = None,
                 sleep: Callable[[float], Any] | None = None) -> None:
        """``ttl_s``: how long the service keeps the sandbox if we never stop it (the dead-man switch;
        default $MILES_AGENT_SANDBOX_TTL_S or 3600). ``retry``: the back-off policy for rate limits and
        transient errors."""
        self.ttl_s = float(ttl_s if ttl_s is not None else os.environ.get("MILES_AGENT_SANDBOX_TTL_S", DEFAULT_TTL_S))
        if self.ttl_s <= 0:
            raise SandboxError(f"{self.name} sandbox: ttl_s must be > 0, got {self.ttl_s}")
        self.retry = retry or RetryPolicy()
        self._sleep = sleep or time.sleep
        self.handle: Any = None  # the service's object for our sandbox, set by _create as soon as it exists
        self.spec = SandboxSpec()
        # The default cwd, where relative paths land: the spec's workdir, else the backend's workspace
        # (a backend may set it from its image in `_create`, before the spec's files are written).
        self.workdir = WORKDIR
        self._started = self._stopped = False
        self._destroy_lock = threading.Lock()

    # -- backend hooks (sync, run in a worker thread) ----------------------------------------------

    @abstractmethod
    def _create(self, spec: SandboxSpec) -> None:
        """Create and start the sandbox; set ``self.handle`` the moment the service has one."""
        ...

    @abstractmethod
    def _exec(self, command: str, timeout_s: float, cwd: str, env: dict[str, str]) -> ExecResult:
        ...

    @abstractmethod
    def _read(self, path: str) -> bytes:
        ...

    @abstractmethod
    def _write(self, path: str, content: bytes) -> None:
        ...

    @abstractmethod
    def _destroy(self, handle: Any) -> None:
        """Remove the sandbox for good; a sandbox that is already gone is success."""
        ...

    def _classify(self, exc: BaseException) -> tuple[str | None, float | None]:
        """(kind, retry_after) of an SDK exception: kind is "rate_limit", "transient", "auth" or None."""
        if isinstance(exc, RetryableError):
            return exc.kind, exc.retry_after
        return None, None

    @property
    def handle_id(self) -> str:
        return str(getattr(self.handle, "id", self.handle))

    # -- retries ---------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[..., T], *args: Any, retry: bool = True, **kwargs: Any) -> T:
        """Call an SDK function, retrying rate limits and transient errors with back-off (bounded)."""
        attempts = self.retry.attempts if retry else 1
        for attempt in range(attempts):
            try:
                return fn(*args, **kwargs)
            except SandboxError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below, re-raised as SandboxError
                kind, retry_after = self._classify(e)
                if kind == "auth":
                    raise SandboxError(f"{self.name} sandbox: {what} refused ({e}); {self.auth_hint}") from e
                if kind not in ("rate_limit", "transient"):
                    raise SandboxError(f"{self.name} sandbox: {what} failed: {e}") from e
                if attempt + 1 >= attempts:
                    raise SandboxError(f"{self.name} sandbox: {what} still failing after {attempts} attempts "
                                       f"({kind}): {e}") from e
                wait = self.retry.delay(attempt, retry_after)
                log.info("%s sandbox: %s hit %s (%s); retrying in %.2fs", self.name, what, kind, e, wait)
                self._sleep(wait)
        raise AssertionError("unreachable")

    # -- the contract ----------------------------------------------------------------------------

    async def start(self, spec: SandboxSpec) -> None:
        if self._started or self._stopped:
            raise SandboxError(f"{self.name} sandbox: start() called twice; create one sandbox per episode")
        self._started = True
        self.spec = spec
        self.workdir = spec.workdir or WORKDIR
        with _live_lock:
            _live[id(self)] = self
        creating = asyncio.ensure_future(asyncio.to_thread(self._create_and_seed, spec))
        try:
            await asyncio.shield(creating)
        except BaseException:
            # Failed half-way or cancelled: let an in-flight create finish, then remove what it made.
            if not creating.done():
                await asyncio.wait([creating])
            await asyncio.shield(asyncio.to_thread(self._destroy_now))
            self._stopped = True
            raise

    def _create_and_seed(self, spec: SandboxSpec) -> None:
        self._create(spec)
        for path, content in spec.files.items():
            self.call(f"write {path}", self._write, workspace_path(path, self.workdir), content)

    async def exec(self, command: str, *, timeout_s: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        self._check_running()
        limit = self.spec.limits.wall_time_s if timeout_s is None else timeout_s
        full_env = {**self.spec.env, **(env or {})}
        where = workspace_path(cwd, self.workdir) if cwd else self.workdir
        # Not retried: a command may have side effects. Only the transport is the backend's to retry.
        result = await asyncio.to_thread(self.call, "exec", self._exec, command, float(limit), where, full_env,
                                         retry=False)
        cap = self.spec.limits.max_output_bytes
        result.stdout, cut_out = truncate(result.stdout, cap)
        result.stderr, cut_err = truncate(result.stderr, cap)
        if cut_out or cut_err:
            result.output_truncated = True
            result.limit_hit = result.limit_hit or "output"
        return result

    async def read_file(self, path: str) -> bytes:
        self._check_running()
        return await asyncio.to_thread(self.call, f"read {path}", self._read, workspace_path(path, self.workdir))

    async def write_file(self, path: str, content: bytes) -> None:
        self._check_running()
        if len(content) > self.spec.limits.max_file_bytes:
            raise SandboxError(f"{self.name} sandbox: {path} is {len(content)} bytes, over max_file_bytes "
                               f"({self.spec.limits.max_file_bytes})")
        await asyncio.to_thread(self.call, f"write {path}", self._write, workspace_path(path, self.workdir), content)

    async def stop(self) -> None:
        self._stopped = True
        # Shielded: a cancelled episode still removes its sandbox.
        await asyncio.shield(asyncio.to_thread(self._destroy_now))

    def _check_running(self) -> None:
        if not self._started or self._stopped or self.handle is None:
            raise SandboxError(f"{self.name} sandbox: not running (call start() first; stop() ends it)")

    def _destroy_now(self, retry: bool = True) -> None:
        """Remove the sandbox if one was created (retried; idempotent; thread-safe)."""
        with self._destroy_lock:
            handle, self.handle = self.handle, None
            with _live_lock:
                _live.pop(id(self), None)
            if handle is None:
                return
            try:
                self.call("remove", self._destroy, handle, retry=retry)
            except BaseException:
                with _live_lock:  # still there: keep it for the exit hook
                    self.handle = handle
                    _live[id(self)] = self
                raise
