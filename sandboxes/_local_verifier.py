"""The local sandbox's verifier staging: which folders a verifier claims, laying them out from the host
side in the verifier's own storage, and reading its outputs back.

The verifier's storage is a tmpfs the agent never has bound (``_local_storage``), emptied before
every run, so nothing the agent did can block, forge or pre-fill it; its outputs are read with the
same symlink-proof resolution as the workspace (``_local_paths``).
"""

from __future__ import annotations

import os
import posixpath

from miles_agent.errors import UserError
from miles_agent.sandbox import VerifierRun

from . import _local_paths as paths

# Top-level folders a verifier may not claim: the system's, and the ones the sandbox itself mounts.
RESERVED_TOPS = frozenset({"", "usr", "etc", "proc", "dev", "sys", "bin", "sbin", "lib", "lib32", "lib64",
                           "libx32", "workspace", "tmp", "root", "home"})


def tops(run: VerifierRun) -> list[str]:
    """The top-level folders the verifier's files and outputs live in (``/tests/x`` -> ``tests``)."""
    tops = set()
    for path in [*run.files, run.output_dir]:
        norm = posixpath.normpath(path)
        top = norm.strip("/").split("/")[0]
        if not norm.startswith("/") or top in RESERVED_TOPS or top == "..":
            raise UserError(f"verifier path {path!r} must be absolute under a folder of its own (like /tests or "
                            f"/logs), not under {', '.join(sorted(t for t in RESERVED_TOPS if t))}")
        tops.add(top)
    return sorted(tops)


def host_binds(run: VerifierRun, tops: list[str]) -> list[tuple[str, str]]:
    """``run.host_dirs`` as (host folder, path inside) read-only binds: each an existing host folder,
    shown at an absolute path outside the system folders and the verifier's own ones."""
    binds = []
    for inside, host in sorted(run.host_dirs.items()):
        norm = posixpath.normpath(inside) if isinstance(inside, str) else ""
        top = norm.strip("/").split("/")[0]
        if not norm.startswith("/") or top in RESERVED_TOPS or top in tops:
            raise UserError(f"verifier host folder {inside!r}: its path inside must be absolute, outside "
                            f"{', '.join('/' + t for t in sorted(t for t in RESERVED_TOPS | set(tops) if t))}, "
                            "e.g. /opt/verifier")
        real = os.path.realpath(host)
        if not os.path.isdir(real):
            raise UserError(f"verifier host folder {host!r} (for {inside}) is not a folder on this machine; "
                            "provision it first or drop it from VerifierRun.host_dirs")
        if os.geteuid() == 0 and not _others_may_read(real):  # the sandbox's own uid mounts it
            raise UserError(f"verifier host folder {host!r} (for {inside}) cannot be read by the sandbox's "
                            "unprivileged uid; make it and every folder above it readable by others "
                            "(chmod o+rx), e.g. provision it under /opt")
        binds.append((real, norm))
    return binds


def _others_may_read(path: str) -> bool:
    """Whether any uid may list ``path``: it readable and enterable by others, every folder above enterable."""
    try:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        while path != "/":
            path = os.path.dirname(path)
            if not os.stat(path).st_mode & 0o001:
                return False
    except OSError:
        return False
    return True


def stage(view: str, tops: list[str], run: VerifierRun) -> None:
    """Empty the verifier's storage, then lay out its fresh home, /tmp, output folder and files."""
    for name in os.listdir(view):
        path = os.path.join(view, name)
        if os.path.isdir(path) and not os.path.islink(path):
            paths.remove_tree(path)
        else:
            os.unlink(path)
    for d in ("tmp", "home", *tops):
        os.mkdir(os.path.join(view, d), 0o1777 if d == "tmp" else 0o755)
    os.makedirs(os.path.join(view, posixpath.normpath(run.output_dir).lstrip("/")), exist_ok=True)
    for path, content in run.files.items():
        target = os.path.join(view, posixpath.normpath(path).lstrip("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(content)


def read_outputs(verifier_dir: str, view: str, run: VerifierRun) -> dict[str, bytes]:
    """The verifier's outputs that exist (regular files, at most ``max_output_file_bytes`` each), resolved
    inside its output folder whatever links the verifier left. Call it as the sandbox's fs user."""
    top, _, rest = run.output_dir.strip("/").partition("/")
    fd = os.open(view, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    outputs = {}
    try:
        for name in run.outputs:
            try:
                outputs[name] = paths.read_workspace_file(verifier_dir, fd, posixpath.join(rest, name), top=top,
                                                          limit=run.max_output_file_bytes)
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
                continue
    finally:
        os.close(fd)
    return outputs
