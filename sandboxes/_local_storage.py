"""A local sandbox's writable storage: size- and inode-limited tmpfs mounts that die with the sandbox.

Everything an agent can write (/workspace, /tmp and /root) lives on one tmpfs mounted with ``size=``
and ``nr_inodes=``: a hard kernel quota, so neither 100k empty files nor many files under the per-file
cap can exhaust the host. The verifier gets a second, smaller tmpfs of its own (its /tests, /logs,
fresh home and /tmp), so an agent that fills its quota cannot starve the verifier.

Where they are mounted: in a private user + mount namespace created by one holder process (``unshare
--user --map-root-user --mount``, run as the sandbox's host identity). Unprivileged callers can mount
tmpfs there, so the quota holds for root and for ordinary users alike, and nothing is mounted on the
host: when the holder dies the kernel frees both mounts, so a crashed run leaks no memory-backed
filesystem. Each command starts in the namespace before bwrap builds the sandbox -- born there when the
caller is root (the spawner thread steps into it around the fork), else through ``nsenter``; the host
reaches the files through ``/proc/<holder>/root``.

The holder is also the init of the sandbox's pid namespace, and every process of the sandbox -- each
command's bwrap, its namespace init, whatever the command left behind -- lives in it (each command's own
pid namespace nests inside): when the holder dies, the kernel kills all of them, whatever they did to
escape. Root callers make that namespace on the spawner thread (``unshare(CLONE_NEWPID)``: owned by the
host's user namespace, so the spawner can put each command in it with ``setns``); ordinary callers with
``unshare --pid --kill-child`` inside the holder's user namespace (``nsenter --pid``). The holder dies
at `stop` (SIGKILL), and with its owner however the owner dies, SIGKILL included: its stdin is a pipe
whose only writer is the owner, so the holder returns when that closes -- no race with a start-up the
owner did not live to finish, unlike the parent-death signal (``PR_SET_PDEATHSIG``, kept as well).
bwrap's own ``--die-with-parent`` is not enough alone: a command's namespace init arms it only once it
is set up (after ``--block-fd``), so an owner killed in between left it running the command unlimited.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from ._local_identity import HostIdentity
from ._local_spawn import SpawnAs, spawn_sync

READY_TIMEOUT_S = 10.0
SYSTEM_BIN = "/usr/bin:/bin:/usr/sbin:/sbin"
# $1: agent mount point, $2: verifier mount point, $3/$4: their tmpfs options, $5: "proc" to mount the pid
# namespace's own /proc (bwrap reads its child's there). stdin: the owner's lifeline (read until it closes;
# meanwhile the shell, the sandbox's pid namespace init, reaps what is reparented to it).
HOLDER_SCRIPT = """set -e
mount -t tmpfs -o "$3" miles-sandbox "$1"
mount -t tmpfs -o "$4" miles-verifier "$2"
mkdir -m 0755 "$1/workspace"; mkdir -m 1777 "$1/tmp"; mkdir -m 0700 "$1/root"
if [ "$5" = proc ]; then mount -t proc -o nosuid,nodev,noexec proc /proc; fi
echo ready
cat > /dev/null || true
"""


@dataclass(frozen=True)
class Quota:
    """A tmpfs quota: bytes of data and inodes (files, folders, links)."""

    bytes: int
    inodes: int

    def tmpfs_options(self) -> str:
        return f"size={self.bytes},nr_inodes={self.inodes},mode=0755"


class StorageError(RuntimeError):
    """The quota'd storage could not be created (missing tools, no user namespaces)."""


class SandboxStorage:
    """The holder process and the paths through which the host and each command reach its mounts."""

    def __init__(self, root: str, identity: HostIdentity, agent: Quota, verifier: Quota) -> None:
        self.root, self.identity, self.agent, self.verifier = root, identity, agent, verifier
        self.agent_dir = os.path.join(root, "fs")  # mount points; the same paths inside the namespace
        self.verifier_dir = os.path.join(root, "verifier")
        self.holder_pid: int | None = None
        self.mount_ns_fd: int | None = None  # root callers' commands are born in it (no nsenter)
        self.pid_ns_fd: int | None = None  # root callers' commands are born in it: the sandbox's, the holder its init
        self._holder = None
        self._pidfd: int | None = None
        self._lifeline: int | None = None  # the holder's stdin, written by no one: closes when we die

    def start(self) -> None:
        """Create the mount points and the holder; StorageError with the tools' own words on failure."""
        setpriv, unshare, nsenter = (shutil.which(t, path=SYSTEM_BIN) for t in ("setpriv", "unshare", "nsenter"))
        if not (setpriv and unshare and nsenter):
            raise StorageError("`setpriv`, `unshare` and `nsenter` (util-linux) are needed for the sandbox's "
                               "disk quota; install util-linux")
        self._nsenter = nsenter
        for path in (self.agent_dir, self.verifier_dir):
            os.mkdir(path, 0o700)
        if self.identity.switched:
            for path in (self.root, self.agent_dir, self.verifier_dir):
                os.chown(path, self.identity.uid, self.identity.gid)
        # Root callers: the holder is born the init of a fresh pid namespace (the spawner's unshare); ordinary
        # callers cannot make one outside a user namespace of their own, so unshare forks its init inside.
        own_pid_ns = self.identity.switched
        pid_args = [] if own_pid_ns else ["--pid", "--kill-child=KILL"]
        argv = [*self.identity.drop_argv, setpriv, "--pdeathsig=KILL", "--", unshare, "--user", "--map-root-user",
                "--mount", "--propagation=private", *pid_args, "--", "/bin/sh", "-c", HOLDER_SCRIPT, "sh",
                self.agent_dir, self.verifier_dir, self.agent.tmpfs_options(), self.verifier.tmpfs_options(),
                "host" if own_pid_ns else "proc"]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        life_r, self._lifeline = os.pipe()
        try:
            self._holder = spawn_sync(argv, env={"PATH": SYSTEM_BIN}, stdout=out_w, stderr=err_w, stdin=life_r,
                                      new_pid_ns=own_pid_ns)
        except BaseException:
            os.close(self._lifeline)
            self._lifeline = None
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
            os.close(life_r)
        try:
            ready = _read_line(out_r, READY_TIMEOUT_S)
            if ready != b"ready":
                self.stop()
                detail = _read_available(err_r).decode(errors="replace").strip()[-500:]
                raise StorageError(f"could not mount the sandbox's quota'd storage: {detail or 'no output'}")
        finally:
            os.close(out_r)
            os.close(err_r)
        self.holder_pid = self._holder.pid
        self._pidfd = os.pidfd_open(self.holder_pid)
        self.mount_ns_fd = os.open(f"/proc/{self.holder_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        if self.identity.switched:
            self.pid_ns_fd = os.open(f"/proc/{self.holder_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            self._mount_proc()

    def _mount_proc(self) -> None:
        """Root callers: the sandbox's pid namespace belongs to the host's user namespace, so the holder
        cannot mount its /proc; a root ``mount`` born in both of its namespaces does (bwrap, living in
        them, reads its child's namespaces in /proc and would find the host's pids there instead)."""
        mount = shutil.which("mount", path=SYSTEM_BIN)
        if not mount:
            self.stop()
            raise StorageError("`mount` (util-linux) is needed for the sandbox's pid namespace; install util-linux")
        err_r, err_w = os.pipe()
        try:
            proc = spawn_sync([mount, "-t", "proc", "-o", "nosuid,nodev,noexec", "proc", "/proc"],
                              env={"PATH": SYSTEM_BIN}, stderr=err_w,
                              spawn_as=SpawnAs(mount_ns_fd=self.mount_ns_fd, pid_ns_fd=self.pid_ns_fd))
        except OSError as e:
            os.close(err_r)
            self.stop()
            raise StorageError(f"could not start mount for the sandbox's /proc: {e}") from None
        finally:
            os.close(err_w)
        try:
            code = proc.wait(timeout=READY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        detail = _read_available(err_r).decode(errors="replace").strip()[-500:]
        os.close(err_r)
        if code != 0:
            self.stop()
            raise StorageError(f"could not mount the sandbox's /proc: {detail or f'exit {code}'}")

    def enter_argv(self) -> list[str]:
        """The prefix that runs a command inside the holder's namespaces (as the sandbox identity). An
        ordinary caller's enters its pid namespace too (nsenter then forks: the command is its child);
        root callers' commands are born in it instead (`pid_ns_fd`), which a dropped uid could not enter."""
        assert self.holder_pid is not None
        pid = [] if self.identity.switched else [f"--pid=/proc/{self.holder_pid}/ns/pid_for_children"]
        return [self._nsenter, f"--target={self.holder_pid}", "--user", "--mount", *pid, "--preserve-credentials",
                "--"]

    def pid_enter_argv(self) -> list[str]:
        """Root callers: the prefix (run as root, before the uid drop) that puts a command launched
        without the spawner (the bwrap probe) in the sandbox's pid namespace; [] for ordinary callers,
        whose `enter_argv` does it."""
        assert self.holder_pid is not None
        return [self._nsenter, f"--target={self.holder_pid}", "--pid", "--"] if self.identity.switched else []

    def host_view(self, path: str) -> str:
        """Where the host finds ``path`` (a path under one of the mount points) right now."""
        assert self.holder_pid is not None
        return f"/proc/{self.holder_pid}/root{path}"

    def usage(self, which: str = "agent") -> tuple[int, int]:
        """(bytes used, inodes used) of the agent's or the verifier's tmpfs."""
        st = os.statvfs(self.host_view(self.agent_dir if which == "agent" else self.verifier_dir))
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree

    def stop(self) -> None:
        """Kill the holder: the kernel kills every process left in the sandbox's pid namespace and frees
        both tmpfs with its mount namespace."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self._holder is None:
            return
        holder, self._holder = self._holder, None
        if holder.poll() is None:
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                else:
                    holder.kill()
            except ProcessLookupError:
                pass
        holder.wait()
        for name in ("mount_ns_fd", "pid_ns_fd"):
            if (fd := getattr(self, name)) is not None:
                os.close(fd)
                setattr(self, name, None)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self.holder_pid = None

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)


def _readable(fd: int, timeout_s: float) -> bool:
    """poll, not select: select refuses fds >= 1024 (FD_SETSIZE), which a few hundred sandboxes at once reach."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _read_line(fd: int, timeout_s: float) -> bytes:
    deadline, data = time.monotonic() + timeout_s, b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not _readable(fd, left):
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].strip()


def _read_available(fd: int) -> bytes:
    data = b""
    while _readable(fd, 0.2):
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data
