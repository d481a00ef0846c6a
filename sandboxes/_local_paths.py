"""Host-side file access to a sandbox's workspace that a hostile sandbox cannot redirect.

The sandbox's own commands can leave symlinks in the workspace (``ln -s /root/.ssh/id_rsa key``). The
trainer reads and writes workspace files as the host user, so every path is resolved the way the
sandbox itself would see it: with ``openat2(RESOLVE_IN_ROOT)`` against the sandbox's filesystem
root (``<sandbox>/fs``, which holds ``workspace/``, ``tmp/`` and ``root/``), so an absolute or ``..``
symlink can never climb out, and the opened file's real path must then lie inside the workspace.
Resolution happens in the kernel, so a symlink swapped concurrently cannot win a race either.
Kernels older than 5.6 have no openat2; there the path is opened with O_PATH, checked, then reopened
(documented race). ``root`` is the folder as the kernel names it (``readlink /proc/self/fd/N``): the
sandbox's storage lives in its own mount namespace, reached through the holder's ``/proc/PID/root``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import shutil
import stat

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall table unification)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_have_openat2: bool | None = None  # unknown until first use


def workspace_relative(path: str, inside_root: str) -> str:
    """``path`` (workspace-relative, or absolute under ``inside_root``) as a workspace-relative path.

    Lexical escapes (``..`` above the workspace, absolute paths elsewhere) are refused here, before
    touching the filesystem; symlinks are handled by `open_in_workspace`.
    """
    if not isinstance(path, str) or "\0" in path:
        raise ValueError(f"invalid sandbox path {path!r}")
    norm = posixpath.normpath(path) if path else "."
    if norm.startswith("/"):
        root = inside_root.rstrip("/")
        if norm == root:
            norm = "."
        elif norm.startswith(root + "/"):
            norm = norm[len(root) + 1:]
        else:
            raise PermissionError(f"path {path!r} is outside the sandbox workspace {inside_root}")
    if norm == ".." or norm.startswith("../"):
        raise PermissionError(f"path {path!r} escapes the sandbox workspace")
    return norm


def _openat2(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root_fd), os.fsencode(path),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def _open_fallback(root: str, root_fd: int, path: str, flags: int, mode: int, top: str) -> int:
    """Pre-5.6 kernels: resolve relative to the root fd with O_PATH (no side effects), check where it
    landed, and only then open it with the real flags (documented race)."""
    if path.startswith("/"):
        raise PermissionError(f"path {path!r} is absolute")
    path_fd = os.open(path, os.O_PATH | os.O_CLOEXEC, dir_fd=root_fd)
    _check_inside(path_fd, os.path.join(root, top), path)
    if flags & os.O_PATH:
        return path_fd
    try:
        return os.open(f"/proc/self/fd/{path_fd}", (flags & ~os.O_CREAT) | os.O_CLOEXEC, mode)
    finally:
        os.close(path_fd)


def _open_in_root(root: str, root_fd: int, path: str, flags: int, mode: int, top: str) -> int:
    global _have_openat2
    if _have_openat2 is not False:
        try:
            fd = _openat2(root_fd, path, flags, mode)
            _have_openat2 = True
            return fd
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM) or _have_openat2:
                raise
            _have_openat2 = False  # no openat2 (or a seccomp filter forbids it)
    return _open_fallback(root, root_fd, path, flags, mode, top)


def _check_inside(fd: int, workspace: str, path: str) -> None:
    workspace = workspace.rstrip("/")  # top "": the sandbox's whole root
    real = os.readlink(f"/proc/self/fd/{fd}")
    if real != workspace and not real.startswith(workspace + "/"):
        os.close(fd)
        raise PermissionError(f"path {path!r} leads outside the sandbox workspace (a symlink?)")


def open_in_workspace(root: str, root_fd: int, rel: str, flags: int, mode: int = 0, *, top: str = "workspace") -> int:
    """An fd for ``rel`` under ``root/top``, resolved as the sandbox sees it, proven inside ``top``."""
    fd = _open_in_root(root, root_fd, posixpath.join(top, rel), flags, mode, top)
    _check_inside(fd, os.path.join(root, top), rel)
    return fd


def _require_regular(fd: int, rel: str) -> None:
    """A FIFO left by the sandbox would block our reader thread forever; only plain files are served."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"{rel!r} is a directory")
        raise PermissionError(f"{rel!r} is not a regular file")


def read_workspace_file(root: str, root_fd: int, rel: str, *, top: str = "workspace", limit: int = -1) -> bytes:
    """A regular file's bytes (at most ``limit``), resolved inside ``root/top`` as the sandbox sees it."""
    fd = open_in_workspace(root, root_fd, rel, os.O_RDONLY | os.O_NONBLOCK, top=top)
    _require_regular(fd, rel)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _ensure_dir(root: str, root_fd: int, rel: str, top: str = "workspace") -> int:
    """An O_PATH fd of workspace directory ``rel``, creating missing parts one verified step at a time."""
    fd = open_in_workspace(root, root_fd, ".", os.O_PATH | os.O_DIRECTORY, top=top)
    done = "."
    for part in [] if rel == "." else rel.split("/"):
        nxt = posixpath.join(done, part)
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        finally:
            os.close(fd)
        fd = open_in_workspace(root, root_fd, nxt, os.O_PATH | os.O_DIRECTORY, top=top)
        done = nxt
    return fd


def _open_for_write(path: str, flags: int, rel: str, dir_fd: int | None = None) -> int:
    try:
        return os.open(path, flags, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise PermissionError(f"{rel!r} is not a regular file") from None
        raise


def write_workspace_file(root: str, root_fd: int, rel: str, content: bytes, *, top: str = "workspace") -> None:
    """Create or replace a workspace file (and its folders); a symlink is followed only if it stays inside."""
    parent, name = posixpath.split(rel)
    if rel in (".", "") or not name:
        raise IsADirectoryError(f"{rel!r} is the workspace itself, not a file")
    dir_fd = _ensure_dir(root, root_fd, parent or ".", top)
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC  # O_TRUNC only once it is known to be a file
    try:
        fd = _open_for_write(name, flags | os.O_CREAT | os.O_NOFOLLOW, rel, dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        # The last part is a symlink: resolve it as the sandbox would, prove it stays inside, then open.
        path_fd = open_in_workspace(root, root_fd, rel, os.O_PATH, top=top)
        try:
            fd = _open_for_write(f"/proc/self/fd/{path_fd}", flags, rel)
        finally:
            os.close(path_fd)
    finally:
        os.close(dir_fd)
    _require_regular(fd, rel)
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    with os.fdopen(fd, "wb") as f:
        f.write(content)


def plain_dirs(root_fd: int, rel: str) -> None:
    """Make ``rel`` (under the root ``root_fd`` opens) a chain of real folders: any symlink, file or
    other non-folder on the way, which a sandbox's command may have left, is removed and replaced by a
    folder, so a bind mount at that path lands exactly there. Run as the sandbox's fs user."""
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    try:
        for part in [p for p in rel.split("/") if p not in ("", ".")]:
            if part == "..":
                raise PermissionError(f"path {rel!r} climbs out of the sandbox")
            try:
                if not stat.S_ISDIR(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(part, dir_fd=fd)
                    os.mkdir(part, 0o755, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def remove_tree(root: str) -> None:
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
