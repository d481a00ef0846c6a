"""A local sandbox's writable storage: size- and inode-limited tmpfs mounts that die with the sandbox.

Everything an agent can write (/workspace, /tmp and /root) lives on one tmpfs mounted with ``size=``
and ``nr_inodes=``: a hard kernel quota, so neither 100k empty files nor many files under the per-file
cap can exhaust the host. The verifier gets a second, smaller tmpfs of its own (its /tests, /logs,
fresh home and /tmp), so an agent that fills its quota cannot starve the verifier.

Where they are mounted: in a private user + mount namespace created by one holder process (``unshare
--user --map-root-user --mount``, run as the sandbox's host identity, then ``sleep``). Unprivileged
callers can mount tmpfs there, so the quota holds for root and for ordinary users alike, and nothing is
mounted on the host: when the holder dies -- at `stop`, or with the trainer itself (``PR_SET_PDEATHSIG``)
-- the kernel frees both mounts, so a crashed run leaks no memory-backed filesystem. Each command
starts in the namespace before bwrap builds the sandbox -- born there when the caller is root (the
spawner thread steps into it around the fork), else through ``nsenter``; the host reaches the files
through ``/proc/<holder>/root``.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import time
from dataclasses import dataclass

from ._local_identity import HostIdentity
from ._local_spawn import spawn_sync

READY_TIMEOUT_S = 10.0
SYSTEM_BIN = "/usr/bin:/bin:/usr/sbin:/sbin"
# $1: agent mount point, $2: verifier mount point, $3/$4: their tmpfs options.
HOLDER_SCRIPT = """set -e
mount -t tmpfs -o "$3" miles-sandbox "$1"
mount -t tmpfs -o "$4" miles-verifier "$2"
mkdir -m 0755 "$1/workspace"; mkdir -m 1777 "$1/tmp"; mkdir -m 0700 "$1/root"
echo ready
exec sleep infinity
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
        self._holder = None
        self._pidfd: int | None = None

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
        argv = [*self.identity.drop_argv, setpriv, "--pdeathsig=KILL", "--", unshare, "--user", "--map-root-user",
                "--mount", "--propagation=private", "--", "/bin/sh", "-c", HOLDER_SCRIPT, "sh", self.agent_dir,
                self.verifier_dir, self.agent.tmpfs_options(), self.verifier.tmpfs_options()]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._holder = spawn_sync(argv, env={"PATH": SYSTEM_BIN}, stdout=out_w, stderr=err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
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

    def enter_argv(self) -> list[str]:
        """The prefix that runs a command inside the holder's namespaces (as the sandbox identity)."""
        assert self.holder_pid is not None
        return [self._nsenter, f"--target={self.holder_pid}", "--user", "--mount", "--preserve-credentials", "--"]

    def host_view(self, path: str) -> str:
        """Where the host finds ``path`` (a path under one of the mount points) right now."""
        assert self.holder_pid is not None
        return f"/proc/{self.holder_pid}/root{path}"

    def usage(self, which: str = "agent") -> tuple[int, int]:
        """(bytes used, inodes used) of the agent's or the verifier's tmpfs."""
        st = os.statvfs(self.host_view(self.agent_dir if which == "agent" else self.verifier_dir))
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree

    def stop(self) -> None:
        """Kill the holder: the kernel frees both tmpfs with its namespace."""
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
        if self.mount_ns_fd is not None:
            os.close(self.mount_ns_fd)
            self.mount_ns_fd = None
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
