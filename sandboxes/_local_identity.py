"""Which host user a local sandbox's commands run as: never host root.

With bubblewrap, uid 0 inside the sandbox is whichever host uid started bwrap. When miles-agent runs as
root (CI, containers, most GPU nodes) that would be the host's uid 0: files under /proc/sys that check
only the writer's uid become writable (``kernel.core_pattern`` then runs a workspace script on the
host as root), root's kernel keys readable. So a root caller starts every sandbox process as an
unprivileged host uid/gid of its own -- one per sandbox, drawn from a range far above ordinary and
subordinate ids (``SANDBOX_UID_BASE``) -- with no supplementary groups and no capabilities: commands
through the spawner's uid switch (``_local_spawn``), the storage holder and the cgroup-v2 fallback
through ``setpriv``, which also empties the bounding set. An ordinary caller runs as itself.

Host-side file access (the trainer writing task files, reading results) runs as that uid too:
`as_fs_user` switches the calling thread's filesystem ids (``setfsuid(2)`` is per thread), so every
file the host puts in the sandbox's storage belongs to the sandbox, and the kernel checks the
sandbox's own permissions on what the host reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass

SANDBOX_UID_BASE = 1_700_000_000  # far above login, system and /etc/subuid ranges (100000 + 65536·n)
SANDBOX_UID_SPAN = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_in_use: set[int] = set()
_lock = threading.Lock()


@dataclass(frozen=True)
class HostIdentity:
    """The host uid/gid a sandbox's processes and files have, and how a root caller becomes them."""

    uid: int
    gid: int
    drop_argv: tuple[str, ...] = ()  # prefix that makes a root process this identity; () when already it

    @property
    def switched(self) -> bool:
        return bool(self.drop_argv)


def claim_identity(setpriv: str | None, uid: int | None = None) -> HostIdentity:
    """The identity for a new sandbox. As root: a fresh uid (or ``uid``) dropped to with ``setpriv``;
    otherwise the caller's own ids."""
    if os.geteuid() != 0:
        return HostIdentity(os.getuid(), os.getgid())
    if not setpriv:
        raise RuntimeError("`setpriv` (util-linux) is needed to run sandboxes as an unprivileged uid "
                           "when miles-agent runs as root; install util-linux")
    with _lock:
        chosen = uid
        while chosen is None or (uid is None and chosen in _in_use):
            chosen = SANDBOX_UID_BASE + random.randrange(SANDBOX_UID_SPAN)
        _in_use.add(chosen)
    drop = (setpriv, f"--reuid={chosen}", f"--regid={chosen}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--")
    return HostIdentity(chosen, chosen, drop)


def release_identity(identity: HostIdentity) -> None:
    with _lock:
        _in_use.discard(identity.uid)


def find_setpriv() -> str | None:
    return shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")


@contextlib.contextmanager
def as_fs_user(identity: HostIdentity) -> Iterator[None]:
    """This thread's file accesses as the sandbox's uid/gid (root callers); a no-op otherwise."""
    if not identity.switched:
        yield
        return
    old_gid = _libc.setfsgid(identity.gid)
    old_uid = _libc.setfsuid(identity.uid)
    try:
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)
