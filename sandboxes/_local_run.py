"""One command in the local sandbox: spawn, limit, watch, kill, and say which limit ended it.

Process layout (bwrap mode): ``sh`` (joins the command's pids cgroup) execs ``bwrap`` (the outer
monitor, our direct child), whose namespace init runs ``prlimit`` (sets the rlimits) which execs
``bash -c``. Plain mode: ``sh`` (cgroup) execs ``prlimit`` execs ``bash -c``.
Killing the outer bwrap with SIGKILL makes the kernel kill its namespace init (``--die-with-parent``),
and the death of a pid namespace's init SIGKILLs every process in it, whatever it did to escape
(``setsid``, ``nohup``, ignoring SIGTERM). The same teardown happens when ``bash -c`` returns, so
background processes never outlive their exec call. bwrap itself returns before the kernel has
finished that teardown, so `Execution` holds the namespace init by pidfd and returns only once it
(and with it every process of the namespace) is gone. In ``isolation="none"`` mode the command's
process group and its cgroup (if any) are killed instead.

Which limit ended a command: our own kills say so directly ("wall_time", "output", "processes");
rlimit deaths are read from the exit status (128+SIGXCPU, 128+SIGXFSZ) and from what bash and
Python print ("File too large", "MemoryError"); the pids cgroup counts refused forks.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from miles_agent.sandbox import ExecResult, SandboxError, SandboxLimits

from ._local_isolation import PidsCgroup
from ._local_spawn import SpawnAs, SpawnedProcess, set_limits, spawn

WATCH_INTERVAL_S = 0.05
READ_CHUNK = 1 << 16
DRAIN_GRACE_S = 1.0  # after the command ends, how long stray pipe holders may keep output open
REAP_TIMEOUT_S = 3.0
MEMORY_PATTERNS = ("MemoryError", "Cannot allocate memory", "cannot allocate", "std::bad_alloc",
                   "out of memory", "Out of memory")
FORK_PATTERNS = ("fork: retry: Resource temporarily unavailable", "fork: Resource temporarily unavailable",
                 "Cannot fork")
KILLED_EXIT = {"wall_time": 124}  # like coreutils `timeout`; every other kill reads as SIGKILL (137)


class CappedOutput:
    """The first and last halves of a stream, up to ``cap`` bytes in all; the middle is counted, not kept."""

    def __init__(self, cap: int) -> None:
        self.head_cap, self.tail_cap = cap // 2, cap - cap // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_cap:
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_cap:  # trim rarely, so a long stream costs O(n)
                del self.tail[:-self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_cap:]) if self.tail_cap else b""
        if not self.truncated:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace")
        dropped = self.total - len(self.head) - len(tail)
        return (self.head.decode("utf-8", errors="replace")
                + f"\n[... {dropped} bytes of output dropped ...]\n"
                + tail.decode("utf-8", errors="replace"))


class _PipeReader:
    """Reads one of the command's output pipes from the event loop into a CappedOutput.

    Our own pipes, not asyncio's: asyncio's Process.wait() also waits for its pipes to close, so a
    stray background process holding stdout would make a finished command look like it hangs.
    """

    def __init__(self, fd: int, buf: CappedOutput, on_data: Callable[[], None]) -> None:
        self.fd: int | None = fd
        self.buf, self.on_data = buf, on_data
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        assert self.fd is not None
        try:
            chunk = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        self.buf.add(chunk)
        self.on_data()

    def close(self) -> None:
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None
        if not self.done.done():
            self.done.set_result(None)


@dataclass
class RunPlan:
    """Everything one command needs; built by LocalSandbox, executed by `Execution`."""

    argv_for: Callable[[dict[str, int]], list[str]]  # the child's pipe fds by role -> argv
    env: dict[str, str]
    cwd: str
    limits: SandboxLimits
    wall_s: float
    isolated: bool  # bwrap (a pid namespace) vs plain subprocess
    cgroup: PidsCgroup | None
    output_kill_bytes: int
    bwrap_args: bytes | None = None  # bwrap's options, fed through ``--args FD``
    init_rlimits: tuple[tuple[int, int, int], ...] = ()  # (resource, soft, hard) set on the namespace init
    limits_as: tuple[int, int] | None = None  # set them as this (uid, gid): root without CAP_SYS_RESOURCE
    spawn_as: SpawnAs = SpawnAs()  # the cgroup and host uid the child starts in


def rlimits(limits: SandboxLimits, *, nproc: int | None) -> tuple[tuple[int, int, int], ...]:
    """(resource, soft, hard): CPU (SIGXCPU at the soft limit, SIGKILL a second later), memory, file
    size, open files, no core dumps, and with ``nproc`` the process count. Only inside a user namespace
    is RLIMIT_NPROC counted per sandbox (the kernel keys the count by user namespace); outside it would
    count every process of the host user, so plain mode leaves it unset."""
    cpu = max(1, int(limits.cpu_time_s))
    values = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
              (resource.RLIMIT_FSIZE, limits.max_file_bytes, limits.max_file_bytes),
              (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files), (resource.RLIMIT_CORE, 0, 0)]
    if nproc is not None:
        values.append((resource.RLIMIT_NPROC, nproc, nproc))
    return tuple(values)


_PRLIMIT_NAMES = {resource.RLIMIT_CPU: "cpu", resource.RLIMIT_AS: "as", resource.RLIMIT_FSIZE: "fsize",
                  resource.RLIMIT_NOFILE: "nofile", resource.RLIMIT_CORE: "core", resource.RLIMIT_NPROC: "nproc"}


def rlimit_argv(prlimit: str, values: tuple[tuple[int, int, int], ...]) -> list[str]:
    """The same limits as a ``prlimit`` prefix (plain mode, where no namespace init can carry them)."""
    return [prlimit, *(f"--{_PRLIMIT_NAMES[r]}={soft}:{hard}" for r, soft, hard in values), "--"]


class Execution:
    """Runs one `RunPlan` to an ExecResult; `kill` may be called from outside (stop)."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self.reason: str | None = None  # the limit (or "stopped") that made us kill it
        self.proc: SpawnedProcess | None = None
        self._pidfd: int | None = None  # our child (the outer bwrap, or bash in plain mode)
        self._init_pid: int | None = None  # bwrap: the namespace init, as a host pid
        self._init_named = False  # bwrap's status named it (as its own pid namespace sees it)
        self._init_pidfd: int | None = None
        self._status = b""
        self._status_fd: int | None = None
        self._block_w: int | None = None  # bwrap --block-fd: written once the init has its rlimits
        self._setup_error: str | None = None
        self._watch_handle: asyncio.TimerHandle | None = None

    def kill(self, reason: str) -> None:
        """Kill the whole command tree, remembering the first reason."""
        if self.reason is None:
            self.reason = reason
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                if self._pidfd is not None:  # race-free: cannot hit a recycled pid
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                else:
                    os.kill(proc.pid, signal.SIGKILL)
                if not self.plan.isolated:
                    os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._init_pidfd is not None:  # also directly: --die-with-parent is a signal, not a guarantee
            try:
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.plan.cgroup is not None:
            self.plan.cgroup.kill_all()

    async def run(self) -> ExecResult:
        start = time.monotonic()
        out, err = CappedOutput(self.plan.limits.max_output_bytes), CappedOutput(self.plan.limits.max_output_bytes)
        readers = await self._spawn(out, err)
        proc = self.proc
        assert proc is not None
        # Timers, not tasks: the wall-time kill and the process watchdog cost no event-loop round trip
        # of their own on a command that ends before them (most do).
        loop = asyncio.get_running_loop()
        wall = loop.call_later(self.plan.wall_s, self.kill, "wall_time")
        self._watch_handle = loop.call_later(WATCH_INTERVAL_S, self._watch)
        try:
            await proc.wait()
        finally:
            wall.cancel()
            self._watch_handle.cancel()
            if proc.returncode is None:  # cancelled from outside: never leave it running
                self.kill("cancelled")
                await asyncio.shield(proc.wait())
            await self._finish(readers)
        return self._result(proc.returncode, out, err, time.monotonic() - start)

    async def _spawn(self, out: CappedOutput, err: CappedOutput) -> list[_PipeReader]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fds: dict[str, int] = {}
        if self.plan.isolated:
            self._status_fd, fds["status"] = os.pipe()
            os.set_blocking(self._status_fd, False)
        if self.plan.bwrap_args is not None:
            fds["args"] = _pipe_with(self.plan.bwrap_args)
        if self.plan.init_rlimits:  # bwrap waits on it, set up but before the command starts
            fds["block"], self._block_w = os.pipe()
        child_fds = tuple(fds.values())
        try:
            self.proc = await spawn(self.plan.argv_for(fds), stdout=out_w, stderr=err_w,
                                    env=self.plan.env, cwd=self.plan.cwd, pass_fds=child_fds,
                                    spawn_as=self.plan.spawn_as)
        except OSError as e:
            os.close(out_r)
            os.close(err_r)
            self._close_status()
            self._close_block()
            raise SandboxError(f"local sandbox: cannot start the command: {e}") from e
        finally:  # the child has its copies; ours would keep the pipes open forever
            for fd in (out_w, err_w, *child_fds):
                os.close(fd)
        self._pidfd = self.proc.pidfd  # None before Linux 5.3: `kill` falls back to os.kill
        if self._status_fd is not None:
            asyncio.get_running_loop().add_reader(self._status_fd, self._on_status)
        return [_PipeReader(out_r, out, lambda: self._check_output(out)),
                _PipeReader(err_r, err, lambda: self._check_output(err))]

    def _on_status(self) -> None:
        """bwrap's JSON status: the first line names the namespace init; hold it by pidfd at once so
        that `_finish` can wait for the whole pid namespace to be gone."""
        assert self._status_fd is not None
        eof = False
        try:
            while chunk := os.read(self._status_fd, 65536):
                self._status += chunk
            eof = True
        except BlockingIOError:
            pass
        except OSError:
            eof = True
        if eof:  # bwrap exited
            asyncio.get_running_loop().remove_reader(self._status_fd)
        self._parse_init()

    def _parse_init(self) -> None:
        if self._init_named:
            return
        for line in self._status.decode(errors="replace").splitlines():
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if "child-pid" in info:
                self._init_named = True
                pid_ns = str(info.get("pid-namespace", ""))
                child = self.proc.pid if self.proc is not None else None
                self._init_pid = _host_pid(child, int(info["child-pid"]), pid_ns)
                if self._init_pid is not None:
                    self._hold_init(pid_ns)
                self._release_init()
                return

    def _hold_init(self, pid_ns: str) -> None:
        """A pidfd of the namespace init, if it is still the process bwrap named (same pid namespace)."""
        try:
            fd = os.pidfd_open(self._init_pid)
        except OSError:
            return
        try:
            same = not pid_ns or os.readlink(f"/proc/{self._init_pid}/ns/pid") == f"pid:[{pid_ns}]"
        except OSError:
            same = False
        if same:
            self._init_pidfd = fd
        else:
            os.close(fd)

    def _release_init(self) -> None:
        """Give the namespace init (blocked in bwrap, before it forks the command) the command's rlimits,
        then let it go: the command inherits them at fork, with no exec of prlimit on the way. Without
        the init's pidfd, or if a limit cannot be set, it is never released -- the command never runs."""
        if self._block_w is None:
            return
        if self._init_pidfd is None:
            self._setup_error = "the sandbox's init vanished before its limits were set"
            self.kill("setup")
            return
        try:
            set_limits(self._init_pid, self.plan.init_rlimits, self.plan.limits_as)
        except OSError as e:
            self._setup_error = f"could not set the command's limits: {e}"
            self.kill("setup")
            return
        os.write(self._block_w, b"x")
        self._close_block()

    def _close_block(self) -> None:
        if self._block_w is not None:
            os.close(self._block_w)
            self._block_w = None

    def _check_output(self, buf: CappedOutput) -> None:
        if buf.total > self.plan.output_kill_bytes and self.reason is None:
            self.kill("output")

    def _watch(self) -> None:
        """Every WATCH_INTERVAL_S while the command runs: a process limit hit ends the command (a fork
        bomb would spin until the wall timeout otherwise)."""
        cg = self.plan.cgroup
        if cg is not None:
            if cg.limit_hits() > 0:
                self.kill("processes")
        elif (n := self._count_processes()) is not None and n > self.plan.limits.max_processes:
            self.kill("processes")
        self._watch_handle = asyncio.get_running_loop().call_later(WATCH_INTERVAL_S, self._watch)

    def _count_processes(self) -> int | None:
        """Processes of this command where no cgroup counts them: the sandbox's own /proc (bwrap), or
        the command's session (plain mode)."""
        if self.plan.isolated:
            if self._init_pid is None:
                return None
            try:
                return sum(1 for p in os.listdir(f"/proc/{self._init_pid}/root/proc") if p.isdigit())
            except OSError:
                return None
        assert self.proc is not None
        return _count_session(self.proc.pid)

    async def _finish(self, readers: list[_PipeReader]) -> None:
        """Make sure nothing of the command is left, then collect the rest of its output."""
        try:
            if not self.plan.isolated:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # background jobs die with their exec
                except (ProcessLookupError, PermissionError):
                    pass
            await self._await_teardown()
            if not all(r.done.done() for r in readers):
                await asyncio.wait([r.done for r in readers], timeout=DRAIN_GRACE_S)
        finally:
            for reader in readers:
                reader.close()
            self._close_status()
            self._close_block()
            if self._init_pidfd is not None:
                os.close(self._init_pidfd)
            if self.proc is not None:
                self.proc.close()  # also closes the pidfd `kill` used
            self._pidfd = self._init_pidfd = None

    async def _await_teardown(self) -> None:
        """bwrap returns as soon as its command does; the kernel then kills the rest of the pid
        namespace. Wait for that (the init's exit) and for the cgroup to be empty."""
        deadline = time.monotonic() + REAP_TIMEOUT_S
        if self._status_fd is not None:
            self._on_status()
        if self._init_pidfd is not None and not _readable(self._init_pidfd):  # not yet gone: wait for it
            loop = asyncio.get_running_loop()
            exited = loop.create_future()
            loop.add_reader(self._init_pidfd, lambda: exited.done() or exited.set_result(None))
            try:
                await asyncio.wait_for(exited, REAP_TIMEOUT_S)
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(self._init_pidfd)
        cg = self.plan.cgroup
        while cg is not None and cg.pids() and time.monotonic() < deadline:
            cg.kill_all()
            await asyncio.sleep(0.002)

    def _close_status(self) -> None:
        if self._status_fd is not None:
            asyncio.get_running_loop().remove_reader(self._status_fd)
            os.close(self._status_fd)
            self._status_fd = None

    def _result(self, returncode: int | None, out: CappedOutput, err: CappedOutput, duration: float) -> ExecResult:
        code = 128 - returncode if returncode is not None and returncode < 0 else (returncode or 0)
        stderr = err.text()
        if self.reason == "stopped":
            raise SandboxError("local sandbox: stopped while the command was running")
        if self._setup_error is not None:
            raise SandboxError(f"local sandbox: {self._setup_error}")
        if self.plan.isolated and self.reason is None and b'"exit-code"' not in self._status:
            raise SandboxError(f"local sandbox: bubblewrap could not set up the sandbox (exit {code}): "
                               f"{stderr.strip()[-500:]}")
        limit = self.reason or _classify(code, stderr, self.plan.cgroup)
        if self.reason is not None:
            code = KILLED_EXIT.get(self.reason, 137)
        return ExecResult(exit_code=code, stdout=out.text(), stderr=stderr, duration_s=duration,
                          timed_out=self.reason == "wall_time",
                          output_truncated=out.truncated or err.truncated, limit_hit=limit)


def _classify(code: int, stderr: str, cgroup: PidsCgroup | None) -> str | None:
    """Which limit a command ran into, where the evidence says so. The kernel's counter and bash's own
    reports of a child killed by SIGXCPU/SIGXFSZ count even when the command then exited 0; the
    weaker evidence (error messages) only when it failed."""
    if (cgroup is not None and cgroup.limit_hits() > 0) or any(p in stderr for p in FORK_PATTERNS):
        return "processes"
    if code == 128 + signal.SIGXCPU or "CPU time limit exceeded" in stderr:
        return "cpu_time"
    if code == 128 + signal.SIGXFSZ or "File size limit exceeded" in stderr:
        return "file_size"
    if code == 0:
        return None
    if "File too large" in stderr:
        return "file_size"
    if any(p in stderr for p in MEMORY_PATTERNS):
        return "memory"
    return None


def _readable(fd: int) -> bool:
    """Whether ``fd`` polls readable now (a pidfd: its process has exited), without blocking. poll, not
    select: select() refuses fds >= 1024, which hundreds of concurrent sandboxes reach."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _host_pid(child: int | None, ns_pid: int, pid_ns: str) -> int | None:
    """The host pid of bwrap's namespace init. bwrap names it as bwrap's own pid namespace sees it --
    the sandbox's, nested in ours (see ``_local_storage``) -- so it is looked for among our child's
    descendants (bwrap's child; with nsenter, which forks into the sandbox's pid namespace, its grandchild):
    the process in pid namespace ``pid_ns`` whose pid one level up is ``ns_pid``. Where /proc lists no
    children (no CONFIG_PROC_CHILDREN), every process is looked at."""
    frontier = [child] if child is not None else []
    for _ in range(3):
        below = [c for pid in frontier for c in _children(pid)]
        for pid in below:
            if _is_init(pid, ns_pid, pid_ns):
                return pid
        frontier = below
    if pid_ns and not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        for name in os.listdir("/proc"):
            if name.isdigit() and _is_init(int(name), ns_pid, pid_ns):
                return int(name)
    return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _is_init(pid: int, ns_pid: int, pid_ns: str) -> bool:
    """Whether ``pid`` is pid 1 of its namespace and ``ns_pid`` in its parent's (and in ``pid_ns``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        if len(nspid) < 2 or nspid[-1] != "1" or nspid[-2] != str(ns_pid):
            return False
        return not pid_ns or os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{pid_ns}]"
    except OSError:
        return False


def _pipe_with(data: bytes) -> int:
    """A pipe's read end with ``data`` already in it (bwrap's options: a few KiB, under the pipe's
    64 KiB buffer, so the write cannot block)."""
    read_fd, write_fd = os.pipe()
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
    finally:
        os.close(write_fd)
    return read_fd


def _count_session(sid: int) -> int:
    """Processes whose session id is ``sid`` (field 6 of /proc/<pid>/stat)."""
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == sid:
            n += 1
    return n
