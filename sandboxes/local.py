"""The local sandbox: bubblewrap-isolated commands in a private per-episode workspace (the embedded default).

Each episode gets a fresh folder ``<tmp>/miles-sandbox-<random>/`` owned by the sandbox, holding
``fs/workspace`` (mounted at /workspace, the cwd), ``fs/tmp`` (/tmp) and ``fs/root`` (/root, HOME):
private to the episode, kept across its exec calls (like one container: an agent's ``/tmp/notes``
survives to its next command), deleted by `stop`. The folder is mode 0700, so nothing a command
leaves there (a setuid file owned by root, say) is reachable by other users of the host.

Every `exec` is its own ``bwrap`` (see ``_local_isolation``): no network, not even the host's
loopback; no host home, /tmp, project or other workspaces; a fresh pid namespace that is torn down
when the command returns, so background processes (``&``, nohup, setsid) never outlive their exec
call. The environment is built from scratch (PATH/HOME/LANG + the spec's and the call's env); the
trainer's own variables never reach the command. Limits per command: wall time (kills the whole
pid namespace), CPU time, address space and file size (rlimits via ``prlimit``), processes (a pids
cgroup, or a watchdog where none is writable), and output (head and tail kept, killed past a hard
cap). ``ExecResult.limit_hit`` names the limit that ended a command where that can be told.

Not enforced here: total disk use of the workspace (only the per-file size), total memory across
processes (the address-space limit is per process) and CPU share; a container sandbox does those.

``LocalSandbox(isolation="none")`` is an explicit, logged, unisolated mode for machines without
bubblewrap: a plain subprocess in the workspace with the same limits and timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from miles_agent.sandbox import ExecResult, Sandbox, SandboxError, SandboxSpec

from . import _local_paths as paths
from ._local_isolation import (
    INSIDE_WORKSPACE,
    INSTALL_HINT,
    BwrapTooOld,
    bwrap_prefix,
    create_pids_cgroup,
    probe_bwrap,
)
from ._local_run import Execution, RunPlan, rlimit_argv

log = logging.getLogger(__name__)

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_JOIN = 'echo $$ > "$0" && exec "$@"'  # sh: join the command's cgroup, then become bwrap/prlimit
MARKER_ENV = "MILES_AGENT_SANDBOX_ID"  # plain mode only: finds escaped processes at stop
MAX_COMMAND_BYTES = 128 << 10  # the kernel refuses a longer single argument (MAX_ARG_STRLEN)
T = TypeVar("T")
_warned_unisolated = False


class LocalSandbox(Sandbox):
    """Commands isolated with bubblewrap in a private workspace: no network, limits, nothing left running."""

    name = "local"
    description = "bubblewrap-isolated commands in a private per-episode workspace (no network, rlimits)"

    def __init__(self, *, isolation: str = "bwrap", bwrap_path: str | None = None,
                 root_dir: str | None = None, use_cgroups: bool = True,
                 output_kill_bytes: int | None = None, extra_ro_binds: Sequence[str] = ()) -> None:
        """``isolation``: "bwrap" (default) or "none" (unisolated, explicit). ``bwrap_path``: the binary
        (default: ``bwrap`` on PATH). ``root_dir``: where workspaces are created (default: the temp dir).
        ``output_kill_bytes``: per-stream output after which a command is killed (default: 16x the
        spec's max_output_bytes, at least 1 MiB). ``extra_ro_binds``: host folders to show read-only."""
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"LocalSandbox isolation must be 'bwrap' or 'none', not {isolation!r}")
        self.isolation = isolation
        self._bwrap_path = bwrap_path
        self._root_dir = root_dir
        self._use_cgroups = use_cgroups
        self._output_kill_bytes = output_kill_bytes
        self._extra_ro_binds = tuple(extra_ro_binds)
        self.id = uuid.uuid4().hex[:12]
        self.root: str | None = None  # the sandbox's host folder while started
        self._fs_fd: int | None = None
        self._spec = SandboxSpec()
        self._prefix: list[str] = []
        self._prlimit = self._bash = ""
        self._running: set[Execution] = set()
        self._exec_count = 0
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, spec: SandboxSpec) -> None:
        if self.root is not None or self._stopped:
            raise SandboxError("local sandbox: start() called twice; create one LocalSandbox per episode")
        if spec.image:
            raise SandboxError(f"the local sandbox cannot run container images (task asks for {spec.image!r}); "
                               "configure a container sandbox (docker, e2b, modal or daytona) for this task")
        bwrap = self._find_tools()
        self.root = tempfile.mkdtemp(prefix="miles-sandbox-", dir=self._root_dir)
        try:
            await self._prepare(spec, bwrap)
        except BaseException:
            await self.stop()
            raise

    def _find_tools(self) -> str | None:
        """The binaries every command needs; a clear SandboxError naming the package when one is missing."""
        bwrap = None
        if self.isolation == "bwrap":
            bwrap = self._bwrap_path or shutil.which("bwrap")
            if not bwrap or not os.access(bwrap, os.X_OK):
                where = f"at {self._bwrap_path}" if self._bwrap_path else "on PATH"
                raise SandboxError(f"local sandbox: bubblewrap (bwrap) not found {where}; {INSTALL_HINT}")
        # The system copy first: in bwrap mode prlimit runs inside, where only /usr and /bin exist.
        self._prlimit = shutil.which("prlimit", path=SYSTEM_PATH) or shutil.which("prlimit") or ""
        self._bash = shutil.which("bash", path="/usr/bin:/bin") or ""
        if not self._prlimit:
            raise SandboxError("local sandbox: `prlimit` not found; install util-linux")
        if not self._bash:
            raise SandboxError("local sandbox: no bash at /usr/bin or /bin; install bash")
        if self.isolation == "none":
            global _warned_unisolated
            if not _warned_unisolated:
                _warned_unisolated = True
                log.warning("LocalSandbox(isolation='none'): commands run UNISOLATED on this host, with "
                            "only rlimits and timeouts; use it only for trusted tasks")
        return bwrap

    async def _prepare(self, spec: SandboxSpec, bwrap: str | None) -> None:
        assert self.root is not None
        fs = os.path.join(self.root, "fs")
        for sub, mode in (("workspace", 0o755), ("tmp", 0o1777), ("root", 0o700)):
            os.makedirs(os.path.join(fs, sub))
            os.chmod(os.path.join(fs, sub), mode)
        self._fs_fd = os.open(fs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._spec = spec
        if bwrap is not None:
            try:
                probed = await probe_bwrap(bwrap, fs)
            except RuntimeError as e:
                advice = ("install a newer bubblewrap" if isinstance(e, BwrapTooOld) else
                          "it needs user namespaces (sysctl kernel.unprivileged_userns_clone=1 or "
                          "user.max_user_namespaces>0; in a container, a seccomp/AppArmor profile that "
                          "permits unshare)")
                raise SandboxError(f"local sandbox: bubblewrap ({bwrap}) does not work here: {e}. Fix: {advice}; "
                                   "or construct LocalSandbox(isolation='none') to run commands without "
                                   "isolation") from None
            self._prefix = bwrap_prefix(probed, fs, self._extra_ro_binds)
        for path, content in spec.files.items():
            await self.write_file(path, content)

    async def stop(self) -> None:
        """Kill every running command (its whole pid namespace), then delete the sandbox's folder."""
        self._stopped = True
        running = list(self._running)
        for execution in running:
            execution.kill("stopped")
        deadline = asyncio.get_running_loop().time() + 5.0
        while self._running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self.isolation == "none":
            await _off_loop(_kill_marked, self.id)
        if self._fs_fd is not None:
            os.close(self._fs_fd)
            self._fs_fd = None
        if self.root is not None:
            root, self.root = self.root, None
            await _off_loop(_remove_tree, root)

    # -- commands ------------------------------------------------------------------------------

    async def exec(self, command: str, *, timeout_s: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        """Run ``bash -c command`` in the sandbox; a limit ends the command, never the sandbox."""
        self._require_started()
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if len(command.encode(errors="surrogateescape")) >= MAX_COMMAND_BYTES:
            # What a shell reports for an over-long command line: the agent's error, not the sandbox's.
            return ExecResult(exit_code=126, stdout="", duration_s=0.0, stderr=(
                f"local sandbox: the command is {len(command)} characters; one command line may be at most "
                f"{MAX_COMMAND_BYTES - 1} bytes (Linux MAX_ARG_STRLEN); write a script file and run it instead\n"))
        limits = self._spec.limits
        inner, command_env = self._inner_argv(command, cwd), self._command_env(env)
        self._exec_count += 1
        cgroup = None
        if self._use_cgroups:  # +2: the outer bwrap and its namespace init live in it too
            cgroup = create_pids_cgroup(f"miles-agent-{self.id}-{self._exec_count}", limits.max_processes + 2)
        head = ["/bin/sh", "-c", CGROUP_JOIN, cgroup.procs_file] if cgroup else []
        isolated = self.isolation == "bwrap"
        inner = rlimit_argv(self._prlimit, limits, nproc=isolated) + inner
        plan = RunPlan(
            argv_for=lambda status_fd: head + self._bwrap_argv(status_fd) + inner,
            env=command_env, cwd=self._host_path("workspace"), limits=limits,
            wall_s=timeout_s if timeout_s is not None else limits.wall_time_s, isolated=isolated,
            cgroup=cgroup, output_kill_bytes=self._output_kill_bytes or max(16 * limits.max_output_bytes, 1 << 20))
        execution = Execution(plan)
        self._running.add(execution)
        try:
            return await execution.run()
        finally:
            self._running.discard(execution)
            if cgroup is not None and not cgroup.remove():
                log.warning("local sandbox: could not remove cgroup %s", cgroup.path)

    def _bwrap_argv(self, status_fd: int | None) -> list[str]:
        if self.isolation != "bwrap":
            return []
        return [*self._prefix, "--json-status-fd", str(status_fd), "--"]

    def _inner_argv(self, command: str, cwd: str | None) -> list[str]:
        """``bash -c command``, first changing to ``cwd`` (relative to the workspace) when given."""
        if "\0" in command:
            raise ValueError("command contains a NUL byte")
        if cwd is None:
            return [self._bash, "-c", command]
        if self.isolation == "none" and not cwd.startswith("/"):
            cwd = os.path.join(self._host_path("workspace"), cwd)
        return [self._bash, "-c", 'cd -- "$1" || exit 1; shift; exec "$BASH" -c "$1"', "bash", cwd, command]

    def _command_env(self, extra: dict[str, str] | None) -> dict[str, str]:
        """The command's whole environment: nothing inherited from this process."""
        if self.isolation == "bwrap":
            env = {"PATH": SYSTEM_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb", "USER": "root"}
        else:
            env = {"PATH": SYSTEM_PATH, "HOME": self._host_path("root"), "TMPDIR": self._host_path("tmp"),
                   "LANG": "C.UTF-8", "TERM": "dumb", MARKER_ENV: self.id}
        for source in (self._spec.env, extra or {}):
            for key, value in source.items():
                if not key or "=" in key or "\0" in key or "\0" in value:
                    raise ValueError(f"invalid environment variable {key!r}")
                env[key] = value
        return env

    # -- files ---------------------------------------------------------------------------------

    async def read_file(self, path: str) -> bytes:
        """A workspace file's bytes. Paths escaping the workspace (``..``, other absolute paths, symlinks
        leading out) raise PermissionError; a missing file FileNotFoundError."""
        rel = self._rel(path)
        return await asyncio.to_thread(self._guard_io, paths.read_workspace_file, rel)

    async def write_file(self, path: str, content: bytes) -> None:
        """Create or replace a workspace file, creating its folders; same path rules as `read_file`."""
        rel = self._rel(path)
        if not isinstance(content, bytes | bytearray | memoryview):
            raise TypeError(f"write_file needs bytes, got {type(content).__name__}")
        await asyncio.to_thread(self._guard_io, paths.write_workspace_file, rel, bytes(content))

    def _rel(self, path: str) -> str:
        self._require_started()
        inside = INSIDE_WORKSPACE if self.isolation == "bwrap" else self._host_path("workspace")
        return paths.workspace_relative(path, inside)

    def _guard_io(self, fn: Callable[..., T], *args: object) -> T:
        """Caller errors (missing file, path escapes) pass through; other OS failures are the sandbox's."""
        assert self.root is not None and self._fs_fd is not None
        try:
            return fn(os.path.join(self.root, "fs"), self._fs_fd, *args)
        except (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise
        except OSError as e:
            raise SandboxError(f"local sandbox: file access failed: {e}") from e

    # -- helpers -------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self.root is None:
            state = "stopped" if self._stopped else "not started"
            raise SandboxError(f"local sandbox is {state}; call start() first")

    def _host_path(self, sub: str) -> str:
        assert self.root is not None
        return os.path.join(self.root, "fs", sub)


async def _off_loop(fn: Callable[[str], None], arg: str) -> None:
    """Cleanup in a worker thread; inline when no thread can be started (a host out of pids must
    still get its sandboxes cleaned up)."""
    try:
        await asyncio.to_thread(fn, arg)
    except RuntimeError:
        fn(arg)


def _kill_marked(sandbox_id: str) -> None:
    """Plain mode: kill processes that escaped the session (double fork + setsid) but kept our marker."""
    needle = f"{MARKER_ENV}={sandbox_id}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(name), 9)
        except (OSError, ProcessLookupError):
            continue


def _remove_tree(root: str) -> None:
    """Delete the sandbox folder, even where a command took away its own folders' permissions."""
    try:
        shutil.rmtree(root)
        return
    except OSError:
        pass
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, stat.S_IRWXU)
                except OSError:
                    pass
    shutil.rmtree(root, ignore_errors=True)
