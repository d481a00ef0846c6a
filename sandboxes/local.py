"""The local sandbox: bubblewrap-isolated commands in a private per-episode workspace (the embedded default).

Each episode gets a fresh folder ``<tmp>/miles-sandbox-<random>/`` (mode 0700, owned by the sandbox's
host uid) whose ``fs/`` is a quota'd tmpfs (``_local_storage``) bound as the sandbox's root filesystem
under the read-only system mounts: the workdir (``SandboxSpec.workdir`` at its real path, e.g. /app;
default /workspace) is the cwd, /tmp and /root (HOME) are its folders, and so is any folder a command
or an absolute ``files`` path makes (/opt/tool, /data). Private to the episode, kept across its exec
calls (like one container: an agent's ``/tmp/notes`` survives to its next command), freed by `stop`. Commands run as an unprivileged host uid of the sandbox's own, also when miles-agent runs as
root (``_local_identity``), each with a fresh session keyring (``_local_spawn``).

Every `exec` is its own ``bwrap`` (see ``_local_isolation``): no network, not even the host's
loopback, unless the task asks for it and the ``network`` policy allows (then the host's); no host home, /tmp, project or other workspaces; a fresh pid namespace that is torn down
when the command returns, so background processes (``&``, nohup, setsid) never outlive their exec
call. The environment is built from scratch (PATH/HOME/LANG + the spec's and the call's env); the
trainer's own variables never reach the command. Limits per command: wall time (kills the whole
pid namespace), CPU time, address space, file size and open files (rlimits via ``prlimit``),
processes (a pids cgroup, else RLIMIT_NPROC counted per sandbox), and output (head and tail kept,
killed past a hard cap); per sandbox: bytes and inodes of everything it can write.
``ExecResult.limit_hit`` names the limit that ended a command where that can be told.

`run_verifier` stages the verifier's files from the host side into a second tmpfs the agent never
sees, and runs it on the agent's final root with those folders (/tests, /logs) bound over it, a fresh
home and /tmp, and ``VerifierRun.host_dirs`` read-only (the verifier's alone).

Not enforced here: total memory across processes (the address-space limit is per process) and CPU
share; a container sandbox does those. docs/sandboxes.md has the threat model.

``LocalSandbox(isolation="none")`` is an explicit, logged, unisolated mode for machines without
bubblewrap: a plain subprocess in the workspace with the same rlimits and timeouts, no quota and no
verifier staging.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from miles_agent.errors import UserError
from miles_agent.sandbox import (
    VERIFIER_PYTHON_ENV,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxSpec,
    VerifierResult,
    VerifierRun,
)

from . import _local_paths as paths
from . import _local_verifier as verifier
from ._local_identity import HostIdentity, as_fs_user, claim_identity, find_setpriv, release_identity
from ._local_isolation import (
    INSIDE_WORKSPACE,
    INSTALL_HINT,
    Bwrap,
    BwrapTooOld,
    PidsCgroup,
    args_blob,
    bwrap_options,
    create_pids_cgroup,
    probe_bwrap,
    system_links,
)
from ._local_run import Execution, RunPlan, rlimit_argv, rlimits
from ._local_spawn import SpawnAs
from ._local_storage import Quota, SandboxStorage, StorageError

log = logging.getLogger(__name__)

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_JOIN = 'echo $$ > "$0" && exec "$@"'  # sh: join the command's cgroup, then exec the rest
MARKER_ENV = "MILES_AGENT_SANDBOX_ID"  # plain mode only: finds escaped processes at stop
MAX_COMMAND_BYTES = 128 << 10  # the kernel refuses a longer single argument (MAX_ARG_STRLEN)
# Top-level names of the sandbox's root that the system mounts hold: no file of a task may go there.
SYSTEM_TOPS = frozenset({"usr", "etc", "proc", "dev", "sys", "bin", "sbin", "lib", "lib32", "lib64", "libx32"})
NETWORK_POLICIES = ("task", "off", "on")
# One uid is mapped (uid 0 inside): tar run as root would try to restore a file's owner (uid 1000) and
# fail the whole extraction; it extracts as root instead, as it does for any other user.
ONE_UID_ENV = {"TAR_OPTIONS": "--no-same-owner"}
T = TypeVar("T")
_warned_unisolated = False


def _has_cap_sys_resource() -> bool:
    """Root may set another uid's rlimits only with CAP_SYS_RESOURCE, which some VMs and containers
    drop; then it sets them acting as the sandbox's uid for a moment (``_local_spawn.set_limits``)."""
    try:
        with open("/proc/self/status") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(eff >> 24 & 1)  # CAP_SYS_RESOURCE


LIMITS_ON_INIT = True  # rlimits onto the namespace init (see _local_run); False: a prlimit exec inside
LIMITS_AS_OWNER = os.geteuid() == 0 and not _has_cap_sys_resource()


@dataclass(frozen=True)
class LocalSandboxOptions:
    """``env.sandbox_options`` of the local backend: LocalSandbox's keywords, typed (see its docstring)."""

    isolation: str = "bwrap"
    bwrap_path: str | None = None
    root_dir: str | None = None
    use_cgroups: bool = True
    output_kill_bytes: int | None = None
    extra_ro_binds: tuple[str, ...] = ()
    sandbox_uid: int | None = None
    network: str = "task"  # the operator's policy: "task" | "off" | "on" (see LocalSandbox)
    verifier_disk_bytes: int = 512 << 20
    verifier_disk_inodes: int = 65536


class LocalSandbox(Sandbox):
    """Commands isolated with bubblewrap in a private workspace: no network, limits, nothing left running."""

    name = "local"
    description = "bubblewrap-isolated commands in a private per-episode workspace (no network, rlimits, quota)"
    options_type: ClassVar[type] = LocalSandboxOptions

    def __init__(self, *, isolation: str = "bwrap", bwrap_path: str | None = None,
                 root_dir: str | None = None, use_cgroups: bool = True,
                 output_kill_bytes: int | None = None, extra_ro_binds: Sequence[str] = (),
                 sandbox_uid: int | None = None, verifier_disk_bytes: int = 512 << 20,
                 verifier_disk_inodes: int = 65536, network: str = "task") -> None:
        """``isolation``: "bwrap" (default) or "none" (unisolated, explicit). ``bwrap_path``: the binary
        (default: ``bwrap`` on PATH). ``root_dir``: where workspaces are created (default: the temp dir).
        ``output_kill_bytes``: per-stream output after which a command is killed (default: 16x the
        spec's max_output_bytes, at least 1 MiB). ``extra_ro_binds``: host folders to show read-only.
        ``sandbox_uid``: with a root caller, the host uid (and gid) commands run as (default: a fresh
        one per sandbox). ``verifier_disk_*``: the quota of the verifier's own storage. ``network``: the
        operator's policy -- "task" (the host's network when the task asks, `SandboxSpec.network`),
        "off" (never; a task's request is logged as overridden), "on" (always)."""
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"LocalSandbox isolation must be 'bwrap' or 'none', not {isolation!r}")
        if network not in NETWORK_POLICIES:
            raise UserError(f"local sandbox: network={network!r} is not a policy; use one of "
                            f"{', '.join(map(repr, NETWORK_POLICIES))}")
        self.network_policy = network
        self.network = False  # whether this sandbox's commands share the host's network (set at start)
        self.workdir = INSIDE_WORKSPACE  # the default cwd inside (the spec's workdir, e.g. /app)
        self.isolation = isolation
        self._bwrap_path = bwrap_path
        self._root_dir = root_dir
        self._use_cgroups = use_cgroups
        self._output_kill_bytes = output_kill_bytes
        self._extra_ro_binds = tuple(extra_ro_binds)
        self._sandbox_uid = sandbox_uid
        self._verifier_quota = Quota(verifier_disk_bytes, verifier_disk_inodes)
        self.id = uuid.uuid4().hex[:12]
        self.root: str | None = None  # the sandbox's host folder while started
        self._fs_fd: int | None = None
        self._fs_root = ""  # the agent storage's folder as the kernel names it
        self._spec = SandboxSpec()
        self._bwrap: Bwrap | None = None
        self._identity = HostIdentity(os.getuid(), os.getgid())
        self._storage: SandboxStorage | None = None
        self._prlimit = self._bash = ""
        self._running: set[Execution] = set()
        self._exec_count = 0
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, spec: SandboxSpec) -> None:
        if self.root is not None or self._stopped:
            raise SandboxError("local sandbox: start() called twice; create one LocalSandbox per episode")
        if spec.image or spec.build:
            what = repr(spec.image) if spec.image else f"an image built from {spec.build.context}"  # type: ignore[union-attr]
            raise SandboxError(f"the local sandbox cannot run container images (task asks for {what}); "
                               "configure a container sandbox (docker, e2b, modal or daytona) for this task")
        self.workdir = _checked_workdir(spec.workdir) if self.isolation == "bwrap" else INSIDE_WORKSPACE
        self.network = self.isolation == "bwrap" and (self.network_policy == "on" or
                                                      (spec.network and self.network_policy == "task"))
        if spec.network and self.network_policy == "off":
            log.warning("local sandbox: the task asks for the network (SandboxSpec.network), but the sandbox's "
                        "network policy is 'off': it runs without (env.sandbox_options={'network': 'task'} "
                        "honours such requests)")
        bwrap = self._find_tools()
        parent = self._root_dir or tempfile.gettempdir()
        if bwrap is not None and os.geteuid() == 0 and not _world_executable(parent):
            raise SandboxError(f"local sandbox: {parent} (where sandbox folders go) cannot be entered by the "
                               "sandbox's unprivileged uid; pass root_dir= (or set TMPDIR to) a folder every user "
                               "can enter, such as /tmp")
        self.root = tempfile.mkdtemp(prefix="miles-sandbox-", dir=parent)
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
            if os.geteuid() == 0 and not _world_executable(bwrap):
                raise SandboxError(f"local sandbox: {bwrap} cannot be run by the sandbox's unprivileged uid (it or a "
                                   "folder above it is not executable by others); install bubblewrap system-wide "
                                   "or make its path world-executable")
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
        self._spec = spec
        if bwrap is None:
            self._fs_root = os.path.join(self.root, "fs")
            for sub, mode in (("workspace", 0o755), ("tmp", 0o1777), ("root", 0o700)):
                os.makedirs(os.path.join(self._fs_root, sub))
                os.chmod(os.path.join(self._fs_root, sub), mode)
            self._fs_fd = os.open(self._fs_root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            await self._prepare_isolated(spec, bwrap)
        for path, content in spec.files.items():  # relative: in the workdir; absolute: at their path
            await self.write_file(path, content)

    async def _prepare_isolated(self, spec: SandboxSpec, bwrap: str) -> None:
        """The sandbox's host identity, its quota'd storage, and a bwrap proven to work through both."""
        assert self.root is not None
        try:
            self._identity = claim_identity(find_setpriv(), self._sandbox_uid)
            limits = spec.limits
            self._storage = SandboxStorage(self.root, self._identity, Quota(limits.disk_bytes, limits.disk_inodes),
                                           self._verifier_quota)
            await asyncio.to_thread(self._storage.start)
            self._fs_root = self._storage.agent_dir
            self._fs_fd = os.open(self._storage.host_view(self._fs_root), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self._guard_io(lambda _r, _fd: self._fix_system_links())
            if self.workdir != INSIDE_WORKSPACE:  # the workdir is a folder of the sandbox's root, like /workspace
                self._guard_io(lambda _r, fd: paths.plain_dirs(fd, self.workdir.lstrip("/")))
                if not self.workdir.startswith(INSIDE_WORKSPACE + "/"):  # the storage's default one, unused here
                    os.rmdir(self._host_path("") + INSIDE_WORKSPACE)
            self._bwrap = await probe_bwrap(bwrap, self._launch_argv(), [], **self._agent_layout())
        except (RuntimeError, OSError) as e:
            advice = ("install a newer bubblewrap" if isinstance(e, BwrapTooOld) else
                      "it needs user namespaces (sysctl user.max_user_namespaces>0, or on Debian/Ubuntu "
                      "kernel.unprivileged_userns_clone=1; in a container, a seccomp/AppArmor profile that "
                      "permits unshare)")
            what = "its storage" if isinstance(e, StorageError) else f"bubblewrap ({bwrap})"
            raise SandboxError(f"local sandbox: {what} does not work here: {e}. Fix: {advice}; or construct "
                               "LocalSandbox(isolation='none') to run commands without isolation") from None

    def _launch_argv(self) -> list[str]:
        """What turns a process of ours into one of the sandbox: its pid namespace (root callers, while still
        root), its identity, then its storage namespaces."""
        assert self._storage is not None
        return [*self._storage.pid_enter_argv(), *self._identity.drop_argv, *self._storage.enter_argv()]

    def _agent_layout(self) -> dict:
        """`bwrap_options` keywords while the agent acts: its storage is the sandbox's root filesystem
        (/workspace or the task's workdir, /tmp, /root, and any folder it makes), under the system mounts."""
        return {"root": self._fs_root, "chdir": self.workdir, "share_net": self.network}

    def _system_links_intact(self) -> bool:
        """Whether the root's merged-usr links are as the host has them: a few readlinks, checked on the
        event loop before each command, so only a command that broke one costs a worker thread's repair."""
        base = self._host_path("")
        for name, target in system_links().items():
            try:
                if os.readlink(os.path.join(base, name)) != target:
                    return False
            except OSError:  # gone, or not a link (a folder or file in its place)
                return False
        return True

    def _fix_system_links(self) -> None:
        """Make the root's merged-usr links (``bin -> usr/bin`` ...) as the host has them, before each
        command (bwrap does not make them in a root of the sandbox's own): a command may have removed
        one or put a folder there (``rm /bin; mkdir /bin``), which would break every later command."""
        for name, target in system_links().items():
            path = os.path.join(self._host_path(""), name)
            try:
                if os.path.islink(path) and os.readlink(path) == target:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    paths.remove_tree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            try:
                os.symlink(target, path)
            except FileExistsError:  # a concurrent command of the same sandbox made it
                pass

    async def stop(self) -> None:
        """Kill every running command (its whole pid namespace), then free the sandbox's storage."""
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
        if self._storage is not None:
            storage, self._storage = self._storage, None
            await storage.astop()
            release_identity(self._identity)
        if self.root is not None:
            root, self.root = self.root, None
            await _off_loop(paths.remove_tree, root)

    # -- commands ------------------------------------------------------------------------------

    async def exec(self, command: str, *, timeout_s: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        """Run ``bash -c command`` in the sandbox; a limit ends the command, never the sandbox."""
        self._require_started()
        if self.isolation == "bwrap" and not self._guard_io(lambda _r, _fd: self._system_links_intact()):
            await asyncio.to_thread(self._guard_io, lambda _r, _fd: self._fix_system_links())
        return await self._run(command, timeout_s, cwd, self._command_env(env),
                               self._agent_layout() if self.isolation == "bwrap" else {})

    async def _run(self, command: str, timeout_s: float | None, cwd: str | None, command_env: dict[str, str],
                   layout: dict) -> ExecResult:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if len(command.encode(errors="surrogateescape")) >= MAX_COMMAND_BYTES:
            # What a shell reports for an over-long command line: the agent's error, not the sandbox's.
            return ExecResult(exit_code=126, stdout="", duration_s=0.0, stderr=(
                f"local sandbox: the command is {len(command)} characters; one command line may be at most "
                f"{MAX_COMMAND_BYTES - 1} bytes (Linux MAX_ARG_STRLEN); write a script file and run it instead\n"))
        limits = self._spec.limits
        inner = self._inner_argv(command, cwd)
        self._exec_count += 1
        cgroup = None
        if self._use_cgroups:  # +2: the outer bwrap and its namespace init live in it too
            cgroup = create_pids_cgroup(f"miles-agent-{self.id}-{self._exec_count}", limits.max_processes + 2)
        head, spawn_as = self._entry(cgroup)
        isolated = self.isolation == "bwrap"
        # RLIMIT_NPROC (+1: the namespace init) is the process limit where no cgroup is; with one it is
        # only a backstop above the cgroup's, whose refusals are counted and end the command at once.
        nproc = (limits.max_processes + (16 if cgroup else 1)) if isolated else None
        values = rlimits(limits, nproc=nproc)
        if isolated:
            assert self._bwrap is not None and self._storage is not None
            enter = [] if head or spawn_as.mount_ns_fd is not None else self._storage.enter_argv()
            launch = head + enter + [self._bwrap.path]
            if LIMITS_ON_INIT:  # set on the namespace init before it starts the command (see _local_run)
                block = lambda fds: ["--block-fd", str(fds["block"])]  # noqa: E731
            else:  # a prlimit exec inside
                block, inner, values = (lambda _fds: []), rlimit_argv(self._prlimit, values) + inner, ()
            argv_for = lambda fds: [*launch, "--args", str(fds["args"]), "--json-status-fd",  # noqa: E731
                                    str(fds["status"]), *block(fds), "--", *inner]
            opts = dict(layout)
            blob = args_blob(bwrap_options(self._bwrap, opts.pop("binds", []), self._extra_ro_binds, **opts))
            workdir = "/"
        else:
            plain = head + rlimit_argv(self._prlimit, values) + inner
            argv_for, blob, workdir, values = (lambda _fds: plain), None, self._host_path("workspace"), ()
        owner = (self._identity.uid, self._identity.gid) if LIMITS_AS_OWNER and self._identity.switched else None
        plan = RunPlan(
            argv_for=argv_for, env=command_env, cwd=workdir, limits=limits, bwrap_args=blob, spawn_as=spawn_as,
            init_rlimits=values, limits_as=owner,
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

    def _entry(self, cgroup: PidsCgroup | None) -> tuple[list[str], SpawnAs]:
        """How a command's first process gets into its cgroup and becomes the sandbox's host uid: set
        by the spawner itself where it can (cgroup v1 threads, Popen's uid switch); else a shell that
        joins the cgroup first, then ``setpriv``."""
        ident = self._identity if self.isolation == "bwrap" else HostIdentity(os.getuid(), os.getgid())
        user: dict = {"uid": ident.uid, "gid": ident.gid} if ident.switched else {}
        # Root callers' commands are born in the sandbox's pid namespace (its holder the init: nothing of the
        # sandbox outlives the holder, nor the holder its owner; see _local_storage); ordinary callers' enter
        # it through nsenter (`enter_argv`).
        pid_ns = {"pid_ns_fd": self._storage.pid_ns_fd} if ident.switched and self._storage is not None else {}
        if ident.switched and self._storage is not None:
            user["mount_ns_fd"] = self._storage.mount_ns_fd
        if cgroup is None:
            return [], SpawnAs(**user, **pid_ns)
        if cgroup.threads_movable:
            return [], SpawnAs(cgroup_tasks=os.path.join(cgroup.path, "tasks"),
                               home_tasks=os.path.join(cgroup.parent, "tasks"), **user, **pid_ns)
        enter = self._storage.enter_argv() if self._storage is not None else []
        return ["/bin/sh", "-c", CGROUP_JOIN, cgroup.procs_file, *ident.drop_argv, *enter], SpawnAs(**pid_ns)

    def _inner_argv(self, command: str, cwd: str | None) -> list[str]:
        """``bash -c command``, first changing to ``cwd`` (relative to the workdir) when given."""
        if "\0" in command:
            raise ValueError("command contains a NUL byte")
        if cwd is None:
            return [self._bash, "-c", command]
        if self.isolation == "none" and not cwd.startswith("/"):
            cwd = os.path.join(self._host_path("workspace"), cwd)
        return [self._bash, "-c", 'cd -- "$1" || exit 1; shift; exec "$BASH" -c "$1"', "bash", cwd, command]

    def _command_env(self, extra: dict[str, str] | None, base: dict[str, str] | None = None) -> dict[str, str]:
        """The command's whole environment: nothing inherited from this process."""
        if self.isolation == "bwrap":
            env = {"PATH": SYSTEM_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb", "USER": "root",
                   **ONE_UID_ENV}
        else:
            env = {"PATH": SYSTEM_PATH, "HOME": self._host_path("root"), "TMPDIR": self._host_path("tmp"),
                   "LANG": "C.UTF-8", "TERM": "dumb", MARKER_ENV: self.id}
        for source in (base if base is not None else self._spec.env, extra or {}):
            for key, value in source.items():
                if not key or "=" in key or "\0" in key or "\0" in value:
                    raise ValueError(f"invalid environment variable {key!r}")
                env[key] = value
        return env

    # -- the verifier --------------------------------------------------------------------------

    async def run_verifier(self, run: VerifierRun) -> VerifierResult:
        """Stage ``run.files`` from the host side into the verifier's own storage (never bound while the
        agent acts, so nothing the agent did can block or alter it), bind each of their top-level
        folders at its absolute path over the agent's final root, with a fresh home and /tmp and
        ``run.host_dirs`` read-only (the verifier's only); the outputs are read back from the host side."""
        self._require_started()
        if self.isolation != "bwrap" or self._storage is None:
            raise UserError("local sandbox: a verifier needs isolation='bwrap' (the unisolated mode cannot show "
                            "files at absolute paths such as /tests); install bubblewrap")
        tops = verifier.tops(run)
        ro_binds = verifier.host_binds(run, tops)
        view = self._storage.host_view(self._storage.verifier_dir)
        await asyncio.to_thread(self._guard_io, lambda _r, _fd: verifier.stage(view, tops, run))
        # A fresh home and /tmp -- unless the workdir lies in one (WORKDIR /root): then the agent's work stays.
        fresh = [(d, inside) for d, inside in (("tmp", "/tmp"), ("home", "/root"))
                 if not (self.workdir + "/").startswith(inside + "/")]
        binds = [(posixpath.join(self._storage.verifier_dir, d), inside)
                 for d, inside in (*fresh, *((t, "/" + t) for t in tops))]

        def mount_points(_r: str, fd: int) -> None:  # whatever the agent left there (a symlink) goes
            self._fix_system_links()
            for inside in [*(i for _, i in binds), *(i for _, i in ro_binds)]:
                paths.plain_dirs(fd, inside.lstrip("/"))
        try:
            await asyncio.to_thread(self._guard_io, mount_points)
        except (PermissionError, OSError) as e:
            if isinstance(e, OSError) and not isinstance(e, PermissionError) and e.errno not in (
                    errno.ENOSPC, errno.EDQUOT, errno.ENOTEMPTY, errno.EISDIR):
                raise
            return VerifierResult(None, setup_error=f"preparing the verifier's folders in the agent's root: {e}")
        env = self._command_env({**VERIFIER_PYTHON_ENV, **run.env})  # the image's ENV too, as a container has it
        layout = {"root": self._fs_root, "binds": binds, "ro_binds": ro_binds, "chdir": self.workdir,
                  "share_net": self.network}
        result = await self._run(run.command, run.timeout_s, None, env, layout)
        vdir = self._storage.verifier_dir
        outputs = await asyncio.to_thread(self._guard_io, lambda _r, _fd: verifier.read_outputs(vdir, view, run))
        return VerifierResult(result, outputs)

    # -- files ---------------------------------------------------------------------------------

    async def read_file(self, path: str) -> bytes:
        """A workspace file's bytes. Paths escaping the workspace (``..``, other absolute paths, symlinks
        leading out) raise PermissionError; a missing file FileNotFoundError."""
        top, rel = self._rel(path)
        return await asyncio.to_thread(self._guard_io, lambda r, fd: paths.read_workspace_file(r, fd, rel, top=top))

    async def write_file(self, path: str, content: bytes) -> None:
        """Create or replace a workspace file, creating its folders; same path rules as `read_file`.
        A full quota raises OSError(ENOSPC/EDQUOT), as a write inside the sandbox would fail."""
        top, rel = self._rel(path)
        if not isinstance(content, bytes | bytearray | memoryview):
            raise TypeError(f"write_file needs bytes, got {type(content).__name__}")
        data = bytes(content)
        await asyncio.to_thread(self._guard_io, lambda r, fd: paths.write_workspace_file(r, fd, rel, data, top=top))

    def _rel(self, path: str) -> tuple[str, str]:
        """(folder of the storage, path under it): a relative path is in the workdir; an absolute one
        (bwrap mode) anywhere in the sandbox's own root except the system mounts (/usr, /etc ...)."""
        self._require_started()
        if self.isolation != "bwrap":
            return "workspace", paths.workspace_relative(path, self._host_path("workspace"))
        if isinstance(path, str) and path.startswith("/"):
            norm = posixpath.normpath(path)
            if norm != self.workdir and not norm.startswith(self.workdir.rstrip("/") + "/"):
                if norm.strip("/").split("/")[0] in SYSTEM_TOPS | {""}:
                    raise PermissionError(f"path {path!r} is in the sandbox's read-only system folders")
                return "", norm.lstrip("/")
        return self.workdir.lstrip("/"), paths.workspace_relative(path, self.workdir)

    def _guard_io(self, fn: Callable[..., T], *args: object) -> T:
        """File access as the sandbox's own host uid. Caller errors (missing file, path escapes, a full
        quota) pass through; other OS failures are the sandbox's."""
        assert self.root is not None and self._fs_fd is not None
        try:
            with as_fs_user(self._identity):
                return fn(self._fs_root, self._fs_fd, *args)
        except (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise SandboxError(f"local sandbox: file access failed: {e}") from e

    # -- helpers -------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self.root is None:
            state = "stopped" if self._stopped else "not started"
            raise SandboxError(f"local sandbox is {state}; call start() first")

    def host_path(self, sub: str = "workspace") -> str:
        """Where the host reaches the agent's ``workspace``, ``tmp`` or ``root`` folder right now (for
        tests and debugging; use `read_file`/`write_file` for access that a symlink cannot redirect)."""
        return self._host_path(sub)

    def _host_path(self, sub: str) -> str:
        """A folder of the agent's storage as the host reaches it (plain mode: a real host path);
        "workspace" is the workdir, wherever the spec put it."""
        assert self.root is not None
        base = self._storage.host_view(self._fs_root) if self._storage is not None else self._fs_root
        if sub == "workspace" and self.isolation == "bwrap":
            sub = self.workdir.lstrip("/")
        return os.path.join(base, sub)


def _checked_workdir(workdir: str | None) -> str:
    """The spec's workdir as a normal absolute path outside the system mounts (default /workspace)."""
    if workdir is None:
        return INSIDE_WORKSPACE
    norm = posixpath.normpath(workdir) if isinstance(workdir, str) else ""
    if not norm.startswith("/") or norm.strip("/").split("/")[0] in SYSTEM_TOPS | {""}:
        raise UserError(f"local sandbox: workdir {workdir!r} must be an absolute folder outside the read-only "
                        f"system folders ({', '.join(sorted('/' + t for t in SYSTEM_TOPS))}), e.g. /app; "
                        "run the task with a container sandbox otherwise")
    return norm


def _world_executable(path: str) -> bool:
    """Whether any uid may run ``path``: the file and every folder above it executable by others."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


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
