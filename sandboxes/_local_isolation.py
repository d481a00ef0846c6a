"""What the local sandbox isolates with: the bubblewrap command line, its probe, and a pids cgroup.

Bubblewrap gives each command its own user, mount, pid, network, ipc, uts and cgroup namespaces.
The mount namespace holds only: /usr and the /bin, /lib* links read-only, an /etc staged from an
allowlist of harmless host files (no shadow, gitconfig, pip.conf, npmrc, ssl/private) plus a
synthesized passwd/group/hosts, fresh /proc (its /proc/sys read-only) and /dev, all over the
sandbox's quota'd storage bound read-write as its root (/): the workdir, /tmp, /root (HOME) and any
folder its commands make; for the verifier also /tests and /logs bound over it, with a fresh /tmp and
home. The host's /root, /home, /tmp and the project are simply absent. The network namespace has only
its own loopback, so a service on the host's 127.0.0.1 is unreachable -- unless the task asked for the
network and the operator allows it (``--share-net``, the host's resolver). bwrap's options reach it through a
pipe (``--args``), so its command line inside shows no host path.

What stops a fork bomb, in order: (1) a pids cgroup per command (v1, or v2 where ``pids`` is
delegated to our cgroup): a hard kernel limit whose refusals are counted, after which the command is
killed at once -- used whenever writable (here: root, cgroup v1). (2) RLIMIT_NPROC, set inside the
user namespace, where the kernel counts it per namespace, i.e. per sandbox; it binds because the
sandbox's host uid is never root (see ``_local_identity``). (3) A watchdog that counts the namespace's processes every 50 ms and kills it
past the limit -- a backstop only.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Host /etc entries a sandbox may see: loader config, alternatives (awk, editor ...), locale and CA
# data. Credentials and host config (shadow, gitconfig, pip.conf, npmrc, ssl/private) stay out.
ETC_ALLOWLIST = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
    "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "mime.types", "magic", "magic.mime",
    "os-release", "debian_version", "protocols", "services", "shells", "terminfo", "perl",
    "gai.conf", "host.conf",
)
SYNTHESIZED_ETC = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files\n",
    "resolv.conf": "",
}
INSIDE_WORKSPACE = "/workspace"
SHM_BYTES = 64 << 20
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora/RHEL: "
                "`dnf install bubblewrap`; Arch: `pacman -S bubblewrap`), or construct "
                "LocalSandbox(isolation='none') to run commands without isolation")


_staged_etc: dict[bool, str] = {}
NETWORK_ETC = ("resolv.conf", "hosts")  # with the host's network: its resolver and hosts, as a container gets


def staged_etc(network: bool = False) -> str:
    """A read-only-to-be /etc for every sandbox of this process: copies of the allowlisted host entries
    plus the synthesized files (``network``: the host's resolv.conf and hosts instead). Built once per
    kind (mounting each entry separately doubled bwrap's start time) and removed at exit."""
    if network in _staged_etc and os.path.isdir(_staged_etc[network]):
        return _staged_etc[network]
    etc = tempfile.mkdtemp(prefix="miles-agent-etc-")
    os.chmod(etc, 0o755)
    python_etc = [p[len("/etc/"):] for p in glob.glob("/etc/python3*")]
    for rel in (*ETC_ALLOWLIST, *python_etc):
        _copy_entry(f"/etc/{rel}", os.path.join(etc, rel))
    for name, text in SYNTHESIZED_ETC.items():
        with open(os.path.join(etc, name), "w") as f:
            f.write(text)
    for name in NETWORK_ETC if network else ():
        os.unlink(os.path.join(etc, name))
        _copy_entry(os.path.realpath(f"/etc/{name}"), os.path.join(etc, name))
    if network:  # names resolve through the host's resolver, as in a container on the host's network
        with open(os.path.join(etc, "nsswitch.conf"), "w") as f:
            f.write(SYNTHESIZED_ETC["nsswitch.conf"].replace("hosts: files", "hosts: files dns"))
    atexit.register(shutil.rmtree, etc, ignore_errors=True)
    _staged_etc[network] = etc
    return etc


def _copy_entry(src: str, dst: str) -> None:
    """Copy a file, folder or symlink as it is (symlinks stay links, resolved inside the sandbox)."""
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, ignore_dangling_symlinks=True)
        elif os.path.isfile(src):
            shutil.copy2(src, dst)
    except OSError:
        pass  # unreadable or vanished: the sandbox simply does not get it


SYSTEM_TOPS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def system_links() -> dict[str, str]:
    """The merged-usr links of the host's root (``bin -> usr/bin`` ...), by top-level name."""
    return {top[1:]: os.readlink(top) for top in SYSTEM_TOPS if os.path.islink(top)}


def _system_mounts(extra_ro_binds: tuple[str, ...], links: bool = True) -> list[str]:
    """/usr read-only, the top-level /bin, /lib* as the host has them (merged-usr links or folders;
    ``links`` False: the sandbox's own root holds the links already, see `system_links`)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in SYSTEM_TOPS:
        if os.path.islink(top):
            if not links:
                continue
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in extra_ro_binds:
        args += ["--ro-bind-try", path, path]
    return args


@dataclass(frozen=True)
class Bwrap:
    """A bwrap binary as probed here: the options it knows (--disable-userns is 0.8+, --size 0.6+)."""

    path: str
    options: frozenset[str] = frozenset()


def bwrap_options(bwrap: Bwrap, binds: Sequence[tuple[str, str]], extra_ro_binds: tuple[str, ...] = (), *,
                  root: str | None = None, chdir: str | None = None, share_net: bool = False,
                  ro_binds: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The sandbox's bwrap options (without the binary, the status fd and the command). ``root``: a
    folder of the storage namespace bound read-write as / (the sandbox's own root filesystem, under
    the system mounts), ``binds``: (path in the storage namespace, path inside) pairs bound read-write
    over it, ``ro_binds`` read-only (host folders), ``chdir`` the cwd (default: the first bind's).
    ``share_net``: the host's network (the task asked for it and the operator allows it).

    uid 0 inside is the sandbox's own unprivileged host uid (see ``_local_identity``), never host
    root; /proc/sys and /proc/sysrq-trigger are bound read-only on top of the fresh /proc all the
    same, so no sysctl is writable whoever runs it."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
            "--unshare-user", "--uid", "0", "--gid", "0"]
    if share_net:
        args.append("--share-net")
    if "--disable-userns" in bwrap.options:  # no user namespace nested inside (less kernel attack surface)
        args.append("--disable-userns")
    if root is not None:
        args += ["--bind", root, "/"]
    args += _system_mounts(extra_ro_binds, links=root is None) + ["--ro-bind", staged_etc(share_net), "/etc"]
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
             "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger", "--dev", "/dev"]
    args += (["--size", str(SHM_BYTES)] if "--size" in bwrap.options else []) + ["--tmpfs", "/dev/shm"]
    for source, inside in binds:
        args += ["--bind", source, inside]
    for source, inside in ro_binds:
        args += ["--ro-bind", source, inside]
    return args + ["--chdir", chdir or binds[0][1]]


def args_blob(options: Sequence[str]) -> bytes:
    """bwrap's ``--args FD`` format: NUL-terminated arguments. Passing them through a pipe keeps the
    host paths out of /proc/1/cmdline inside the sandbox."""
    return b"".join(os.fsencode(a) + b"\0" for a in options)


_probe_cache: dict[str, Bwrap] = {}


class BwrapTooOld(RuntimeError):
    """This bubblewrap cannot report its command's status (--json-status-fd arrived in 0.5)."""


async def _run(argv: list[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace").strip()


async def probe_bwrap(path: str, launch: Sequence[str], binds: Sequence[tuple[str, str]], **layout: Any) -> Bwrap:
    """Check once per bwrap binary that it can build our sandbox (``launch``: the prefix that enters
    the sandbox's identity and storage; ``layout``: `bwrap_options`' keywords). RuntimeError with
    bwrap's own words when it cannot, or when it is too old to report its command's status (< 0.5)."""
    if path in _probe_cache:
        return _probe_cache[path]
    _, usage = await _run([path, "--help"])
    options = frozenset(re.findall(r"--[a-z][a-z0-9-]*", usage))
    if "--json-status-fd" not in options:
        raise BwrapTooOld(f"{path} is too old (no --json-status-fd; bubblewrap 0.5 or newer is needed)")
    bwrap = Bwrap(path, options)
    code, out = await _run([*launch, path, *bwrap_options(bwrap, binds, **layout), "--", "/bin/sh", "-c", "exit 0"])
    if code != 0:
        raise RuntimeError(out or f"exit {code}")
    _probe_cache[path] = bwrap
    return bwrap


# -- pids cgroup ----------------------------------------------------------------------------------

def _own_cgroup_dirs() -> list[str]:
    """Candidate parents for our cgroups: the pids v1 hierarchy, then cgroup v2, at our own cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    v1 = {c: p for _, cs, p in (ln.split(":", 2) for ln in lines) for c in cs.split(",") if c}
    v2 = next((p for h, cs, p in (ln.split(":", 2) for ln in lines) if h == "0" and cs == ""), None)
    found = []
    for m in mounts:
        sep = m.index("-")
        fstype, options = m[sep + 1], m[sep + 3] if len(m) > sep + 3 else ""
        if fstype == "cgroup" and "pids" in options.split(",") and "pids" in v1:
            found.append(_on_disk(m[4], m[3], v1["pids"]))
        elif fstype == "cgroup2" and v2 is not None:
            found.append(_on_disk(m[4], m[3], v2))
    return found


def _on_disk(mount_point: str, mount_root: str, cgroup: str) -> str:
    """Where cgroup path ``cgroup`` lives under a mount of ``mount_root`` (containers mount a subtree)."""
    if mount_root != "/" and cgroup.startswith(mount_root):
        cgroup = cgroup[len(mount_root):]
    return (mount_point.rstrip("/") + "/" + cgroup.strip("/")).rstrip("/")


@dataclass
class PidsCgroup:
    """One command's pids cgroup: a hard process limit, its hit counter, and everything inside it."""

    path: str
    parent: str = ""  # the cgroup we live in (where a thread moved in for a spawn goes back to)

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    @property
    def threads_movable(self) -> bool:
        """cgroup v1 moves single threads (``tasks``): the spawner thread steps in, forks, steps out."""
        return os.path.exists(os.path.join(self.path, "tasks")) and os.path.exists(os.path.join(self.parent, "tasks"))

    def limit_hits(self) -> int:
        """How many forks the limit refused (``max`` in pids.events)."""
        try:
            with open(os.path.join(self.path, "pids.events")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        try:
            with open(self.procs_file) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self) -> None:
        kill_file = os.path.join(self.path, "cgroup.kill")  # v2, Linux 5.14+
        if os.path.exists(kill_file):
            try:
                with open(kill_file, "w") as f:
                    f.write("1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def remove(self) -> bool:
        try:
            os.rmdir(self.path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False


_cgroup_parent: str | None | bool = False  # False: not yet looked for; None: none usable


def _usable_parent(parent: str) -> bool:
    probe = os.path.join(parent, f"miles-agent-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return os.path.exists(os.path.join(probe, "pids.max"))
    finally:
        os.rmdir(probe)


STALE_CGROUP_S = 300.0  # an empty command cgroup this old belongs to no live command


def remove_stale_cgroups(parent: str, older_than_s: float = STALE_CGROUP_S) -> int:
    """Remove the empty command cgroups (``miles-agent-*``) a killed owner left under ``parent`` (the
    owner that removes each at its command's end did not live to); how many went. The kernel refuses
    to remove a cgroup that holds a process, so a live command's is never touched; the age keeps it off
    one made a moment ago whose command is yet to join it."""
    removed, now = 0, time.time()
    try:
        names = [n for n in os.listdir(parent) if n.startswith("miles-agent-")]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(parent, name)
        try:
            if now - os.stat(path).st_mtime < older_than_s:
                continue
            os.rmdir(path)
            removed += 1
        except OSError:  # busy (a live command's), gone already, not ours to remove
            continue
    return removed


def create_pids_cgroup(name: str, max_pids: int) -> PidsCgroup | None:
    """A fresh cgroup limited to ``max_pids`` tasks, or None where no pids controller is writable. The
    first call of a process also removes what killed owners left (`remove_stale_cgroups`)."""
    global _cgroup_parent
    if _cgroup_parent is False:
        _cgroup_parent = next((p for p in _own_cgroup_dirs() if _usable_parent(p)), None)
        if _cgroup_parent:
            remove_stale_cgroups(_cgroup_parent)
    if not _cgroup_parent:
        return None
    path = os.path.join(str(_cgroup_parent), name)
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_pids))
    except OSError:
        PidsCgroup(path).remove()
        return None
    return PidsCgroup(path, str(_cgroup_parent))
