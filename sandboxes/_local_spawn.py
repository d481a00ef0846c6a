"""Starting a sandbox process from one spawner thread, which takes on the child's identity around a vfork.

Why a thread of its own: what a child inherits at fork is its parent *thread*'s state, and the
spawner thread can set that state per spawn without touching the trainer's other threads, and
without an exec of a helper (sh, setpriv, nsenter, prlimit) on every command:
- a fresh, empty session keyring (``KEYCTL_JOIN_SESSION_KEYRING``): a process possesses every key of
  its session keyring whatever its uid, so a child of the trainer's thread could read its login's keys;
- the command's pids cgroup (v1 moves single threads): the thread steps in, forks, steps out;
- the sandbox's uid/gid (raw per-thread ``setres[ug]id``, see `_as_ids`), not Popen(user=), which forks;
- the storage's mount namespace (``setns``, root callers), so no ``nsenter`` is needed;
- the sandbox's pid namespace (``setns``, root callers; ``unshare`` for the holder that is its init), so
  every process of a sandbox lives in one pid namespace that dies with its holder (see ``_local_storage``).
`set_limits` lowers rlimits as their owner where root lacks CAP_SYS_RESOURCE (on the caller's thread). The thread
lives as long as the process: a child's ``PR_SET_PDEATHSIG`` (the storage holder's) fires when the
thread that spawned it exits.

`SpawnedProcess` is the small part of asyncio's Process that `Execution` needs, waited on by pidfd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import resource
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_SYSCALL_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280}
_SYSCALL_SETRESUID = {"x86_64": 117, "aarch64": 147, "riscv64": 147, "ppc64le": 164, "s390x": 208}
_SYSCALL_SETRESGID = {"x86_64": 119, "aarch64": 149, "riscv64": 149, "ppc64le": 169, "s390x": 210}
_SYSCALL_SETGROUPS = {"x86_64": 116, "aarch64": 159, "riscv64": 159, "ppc64le": 81, "s390x": 206}
_KEYCTL_JOIN_SESSION_KEYRING = 1

_libc = ctypes.CDLL(None, use_errno=True)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _keyctl_number() -> int | None:
    return _SYSCALL_KEYCTL.get(os.uname().machine)


def join_fresh_session_keyring() -> bool:
    """Give the calling thread a new, empty anonymous session keyring; False where keyrings are absent."""
    number = _keyctl_number()
    if number is None:
        return False
    result = _libc.syscall(ctypes.c_long(number), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))
    return result >= 0


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The process's spawner thread (a new one in a forked child, where the parent's thread is gone)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-sandbox-spawn")
            _pool_pid = os.getpid()
        return _pool


@dataclass(frozen=True)
class SpawnAs:
    """Who the child becomes before its first exec, all set on the spawner thread around the fork (so no
    shell or setpriv exec is needed): a cgroup (v1), a uid/gid with no supplementary groups, a mount
    namespace."""

    cgroup_tasks: str | None = None  # the cgroup's ``tasks`` file
    home_tasks: str | None = None  # where the spawner thread goes back to
    uid: int | None = None
    gid: int | None = None
    mount_ns_fd: int | None = None  # born in this mount namespace (root callers: no nsenter exec)
    pid_ns_fd: int | None = None  # born in this pid namespace: the sandbox's, whose init is its holder


def _move_thread(tasks_file: str) -> None:
    with open(tasks_file, "w") as f:
        f.write(str(threading.get_native_id()))


_CLONE_FS, _CLONE_NEWNS = 0x200, 0x20000
_home_mount_ns: int | None = None  # the spawner thread's own mount namespace, to come back to


@contextlib.contextmanager
def _in_mount_ns(fd: int | None) -> Iterator[None]:
    """The spawner thread inside mount namespace ``fd`` around a fork. setns(2) into a mount namespace
    needs a thread with a filesystem context of its own (``unshare(CLONE_FS)``, once) and, for one
    owned by another user namespace, CAP_SYS_ADMIN: root callers only."""
    global _home_mount_ns
    if fd is None:
        yield
        return
    if _home_mount_ns is None:
        if _libc.unshare(_CLONE_FS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_FS)")
        _home_mount_ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    if _libc.setns(fd, _CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "setns(mount namespace)")
    try:
        yield
    finally:
        if _libc.setns(_home_mount_ns, _CLONE_NEWNS) != 0:  # never leave the spawner elsewhere
            raise OSError(ctypes.get_errno(), "setns back to the spawner's mount namespace")


_CLONE_NEWPID = 0x20000000
_home_pid_ns: tuple[int, int] | None = None  # (process id, fd): the spawner thread's own pid namespace


def _home_pid_ns_fd() -> int:
    global _home_pid_ns
    if _home_pid_ns is None or _home_pid_ns[0] != os.getpid():  # a forked child has a spawner of its own
        _home_pid_ns = (os.getpid(), os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
    return _home_pid_ns[1]


@contextlib.contextmanager
def _in_pid_ns(fd: int | None, new: bool = False) -> Iterator[None]:
    """The spawner thread's next child born in pid namespace ``fd`` (``new``: in a fresh one, as its init),
    then back. setns/unshare(CLONE_NEWPID) change only whose pid namespace the thread's children get (the
    thread itself stays where it is), which root may do on one thread of many; a pid namespace's init
    takes every process of it down when it dies, those of nested namespaces (each command's) included."""
    if fd is None and not new:
        yield
        return
    home = _home_pid_ns_fd()
    if new:
        if _libc.unshare(_CLONE_NEWPID) != 0:
            raise OSError(ctypes.get_errno(), "unshare(pid namespace)")
    elif _libc.setns(fd, _CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "setns(pid namespace)")
    try:
        yield
    finally:
        if _libc.setns(home, _CLONE_NEWPID) != 0:  # never leave the spawner's children elsewhere
            raise OSError(ctypes.get_errno(), "setns back to the spawner's pid namespace")


def _spawn_now(argv: Sequence[str], env: dict[str, str], cwd: str, stdout: int | None, stderr: int | None,
               pass_fds: Sequence[int], spawn_as: SpawnAs, stdin: int | None = None,
               new_pid_ns: bool = False) -> subprocess.Popen:
    join_fresh_session_keyring()
    if spawn_as.cgroup_tasks and spawn_as.home_tasks:
        _move_thread(spawn_as.cgroup_tasks)
    try:
        with (_in_mount_ns(spawn_as.mount_ns_fd), _in_pid_ns(spawn_as.pid_ns_fd, new_pid_ns),
              _as_ids(spawn_as.uid, spawn_as.gid)):
            return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL if stdin is None else stdin, stdout=stdout,
                                    stderr=stderr, env=env, cwd=cwd, pass_fds=tuple(pass_fds),
                                    start_new_session=True, close_fds=True)
    finally:
        if spawn_as.cgroup_tasks and spawn_as.home_tasks:
            _move_thread(spawn_as.home_tasks)


def _syscall_number(table: dict[str, int]) -> int:
    machine = os.uname().machine
    if machine not in table:
        raise OSError(errno.ENOSYS, f"the local sandbox does not know this syscall's number on {machine}; "
                                    "run miles-agent as an ordinary user there, or add it to _local_spawn")
    return table[machine]


def _thread_setres(table: dict[str, int], real: int, effective: int, saved: int) -> None:
    """setres[ug]id for the calling thread only: the raw syscall (glibc's wrapper changes every thread)."""
    number = _syscall_number(table)
    if _libc.syscall(ctypes.c_long(number), ctypes.c_long(real), ctypes.c_long(effective), ctypes.c_long(saved)) != 0:
        raise OSError(ctypes.get_errno(), "setres[ug]id")


@contextlib.contextmanager
def _as_ids(uid: int | None, gid: int | None) -> Iterator[None]:
    """This thread as uid/gid with no supplementary groups, keeping root as its saved id, and back.

    Why not Popen(user=...): CPython then forks instead of vfork-ing, and fork copies the trainer's
    page tables -- 150 ms per command from a 4 GiB process. A child vfork-ed from this thread starts with
    the thread's ids; its exec sets the saved id to the effective one and leaves it no capabilities."""
    if uid is None:
        yield
        return
    groups = os.getgroups()
    _thread_setgroups([])
    try:
        _thread_setres(_SYSCALL_SETRESGID, gid if gid is not None else uid, gid if gid is not None else uid, 0)
        try:
            _thread_setres(_SYSCALL_SETRESUID, uid, uid, 0)
            try:
                yield
            finally:
                _thread_setres(_SYSCALL_SETRESUID, 0, 0, 0)  # first: restoring the gid needs root back
        finally:
            _thread_setres(_SYSCALL_SETRESGID, 0, 0, 0)
    finally:
        _thread_setgroups(groups)


def _thread_setgroups(groups: Sequence[int]) -> None:
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    number = _syscall_number(_SYSCALL_SETGROUPS)
    if _libc.syscall(ctypes.c_long(number), ctypes.c_long(len(groups)), array) != 0:
        raise OSError(ctypes.get_errno(), "setgroups")


def _set_limits_as(uid: int, gid: int, pid: int, values: Sequence[tuple[int, int, int]]) -> None:
    """Lower another uid's rlimits as that uid (prlimit(2) allows an owner to; root without
    CAP_SYS_RESOURCE may not)."""
    with _as_ids(uid, gid):
        for res, soft, hard in values:
            resource.prlimit(pid, res, (soft, hard))


def set_limits(pid: int, values: Sequence[tuple[int, int, int]], as_ids: tuple[int, int] | None) -> None:
    """Set rlimits on ``pid``; with ``as_ids`` (uid, gid), acting as their owner for those few syscalls.
    The switch is the calling thread's alone (raw per-thread syscalls, back to root in ``finally``), and
    nothing else runs on it meanwhile, so the event loop may do it itself: no hop to the spawner thread
    and back on every command."""
    if as_ids is None:
        for res, soft, hard in values:
            resource.prlimit(pid, res, (soft, hard))
        return
    _set_limits_as(as_ids[0], as_ids[1], pid, values)


class SpawnedProcess:
    """A child started by the spawner thread; ``wait`` resolves when it exits (pidfd, no SIGCHLD games)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid
        try:
            self.pidfd: int | None = os.pidfd_open(popen.pid)
        except OSError:
            self.pidfd = None  # kernel before 5.3: wait polls instead

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen.returncode is None else self._popen.returncode

    async def wait(self) -> int:
        while self.returncode is None:
            if self.pidfd is None:
                await asyncio.sleep(0.005)
                continue
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self.pidfd, _resolve, exited)
            try:
                if self.returncode is None:
                    await exited
            finally:
                loop.remove_reader(self.pidfd)
        return self._popen.returncode

    def close(self) -> None:
        """Release the pidfd (once `wait` returned, the child is reaped)."""
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def spawn(argv: Sequence[str], *, env: dict[str, str], cwd: str, stdout: int | None = None,
                stderr: int | None = None, pass_fds: Sequence[int] = (), spawn_as: SpawnAs = SpawnAs()) -> SpawnedProcess:
    """Start ``argv`` from the spawner thread (fresh session keyring, own session, no inherited fds)."""
    loop = asyncio.get_running_loop()
    popen = await loop.run_in_executor(_spawner(), _spawn_now, argv, env, cwd, stdout, stderr, pass_fds, spawn_as)
    return SpawnedProcess(popen)


def spawn_sync(argv: Sequence[str], *, env: dict[str, str], cwd: str = "/", stdout: int | None = None,
               stderr: int | None = None, stdin: int | None = None, pass_fds: Sequence[int] = (),
               new_pid_ns: bool = False, spawn_as: SpawnAs = SpawnAs()) -> subprocess.Popen:
    """`spawn` for a caller in a worker thread (the storage holder: started once per sandbox, its argv
    dropping the ids itself; its /proc's mount). ``new_pid_ns`` (root callers): the child is the init of
    a fresh pid namespace."""
    return _spawner().submit(_spawn_now, argv, env, cwd, stdout, stderr, pass_fds, spawn_as, stdin,
                             new_pid_ns).result()
