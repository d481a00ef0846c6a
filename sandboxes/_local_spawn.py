"""Starting a sandbox process: from one spawner thread, each child with a fresh, empty session keyring.

Why a thread of its own: the kernel hands a child its parent thread's session keyring, and a process
*possesses* every key in its session keyring whatever its uid -- so a command started straight from
the trainer could read keys the trainer's login put there, even after dropping to another uid. The
spawner thread joins a new anonymous session keyring before every spawn (``keyctl(2)``
``KEYCTL_JOIN_SESSION_KEYRING``, a per-thread credential), so each command starts with an empty one
of its own and the trainer's other threads keep theirs. The thread lives as long as the process: a
child's ``PR_SET_PDEATHSIG`` (the storage holder's) fires when the thread that spawned it exits.

`SpawnedProcess` is the small part of asyncio's Process that `Execution` needs, waited on by pidfd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

_SYSCALL_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280}
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
    """Who the child becomes before its first exec: a cgroup (v1, joined by the spawner thread around
    the fork, so no shell is needed to join it) and a uid/gid with no supplementary groups."""

    cgroup_tasks: str | None = None  # the cgroup's ``tasks`` file
    home_tasks: str | None = None  # where the spawner thread goes back to
    uid: int | None = None
    gid: int | None = None


def _move_thread(tasks_file: str) -> None:
    with open(tasks_file, "w") as f:
        f.write(str(threading.get_native_id()))


def _spawn_now(argv: Sequence[str], env: dict[str, str], cwd: str, stdout: int | None, stderr: int | None,
               pass_fds: Sequence[int], spawn_as: SpawnAs) -> subprocess.Popen:
    join_fresh_session_keyring()
    user = {} if spawn_as.uid is None else {"user": spawn_as.uid, "group": spawn_as.gid, "extra_groups": []}
    if spawn_as.cgroup_tasks and spawn_as.home_tasks:
        _move_thread(spawn_as.cgroup_tasks)
    try:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                pass_fds=tuple(pass_fds), start_new_session=True, close_fds=True, **user)
    finally:
        if spawn_as.cgroup_tasks and spawn_as.home_tasks:
            _move_thread(spawn_as.home_tasks)


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
        """Reap (the caller waited) and release the pidfd."""
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
               stderr: int | None = None, pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """`spawn` for callers without an event loop (the storage holder is started from either)."""
    return _spawner().submit(_spawn_now, argv, env, cwd, stdout, stderr, pass_fds, SpawnAs()).result()
