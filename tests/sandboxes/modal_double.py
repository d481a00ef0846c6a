"""A test double of the ``modal`` SDK's Python API for the Modal sandbox.

Modal speaks gRPC (with its own auth handshake and blob store) to its servers, which is not practical to
fake on the wire here, so this double sits at the SDK's Python boundary instead: the same call shapes the
backend uses (``App.lookup``, ``Image.from_registry``, ``Sandbox.create`` / ``exec`` / ``filesystem`` /
``terminate``) and the SDK's *real* exception classes (``modal.exception``), raised as injected faults.
Sandboxes are temp folders; their main process and execs are real host subprocesses (path ``/x`` is
``<folder>/x``), and a sandbox's ``timeout`` really terminates it. ``live`` says what still exists.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from types import SimpleNamespace

import modal.exception as exception


class _Stream:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def read(self) -> bytes:
        return self._data


class _Process:
    def __init__(self, popen: subprocess.Popen, timeout: int | None) -> None:
        self._popen, self._timeout = popen, timeout
        self.stdout = self.stderr = None

    def wait(self) -> int:
        try:
            out, err = self._popen.communicate(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.communicate()
            raise exception.ExecTimeoutError("exec timed out") from None
        self.stdout, self.stderr = _Stream(out), _Stream(err)
        code = self._popen.returncode
        return code if code >= 0 else 128 - code


class _Filesystem:
    def __init__(self, sb: _Sandbox) -> None:
        self._sb = sb

    def make_directory(self, path: str, *, create_parents: bool = True) -> None:
        self._sb._double._maybe_fail("make_directory")
        os.makedirs(self._sb.host_path(path), exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(self._sb.host_path(path), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise exception.SandboxFilesystemNotFoundError(f"{path}: no such file") from None

    def write_bytes(self, data: bytes, path: str) -> None:
        self._sb._double._maybe_fail("write_bytes")
        with open(self._sb.host_path(path), "wb") as f:
            f.write(data)


class _Sandbox:
    def __init__(self, double: ModalDouble, args: tuple[str, ...], kwargs: dict) -> None:
        self._double, self.kwargs = double, kwargs
        self.object_id = "sb-" + uuid.uuid4().hex[:12]
        self.root = tempfile.mkdtemp(prefix=self.object_id + "-", dir=double.tmp)
        self.procs = [subprocess.Popen(list(args), cwd=self.root, start_new_session=True)]
        self.filesystem = _Filesystem(self)
        self.deadline = time.time() + kwargs["timeout"]

    def host_path(self, path: str) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise exception.SandboxFilesystemPermissionError(f"{path} escapes the sandbox")
        return full

    def exec(self, *args: str, timeout: int | None = None, workdir: str | None = None,
             env: dict | None = None, text: bool = True) -> _Process:
        self._double._maybe_fail("exec")
        if self.object_id not in self._double.sandboxes:
            raise exception.SandboxTerminatedError("the sandbox has been terminated")
        full_env = {"PATH": os.environ["PATH"], **(self.kwargs.get("env") or {}), **(env or {})}
        p = subprocess.Popen(list(args), cwd=self.host_path(workdir or "/"), env=full_env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.procs.append(p)
        return _Process(p, timeout)

    def terminate(self) -> None:
        self._double._maybe_fail("terminate")
        self._double._remove(self.object_id)


class ModalDouble:
    """Use as ``ModalSandbox(sdk=double)``; ``with ModalDouble() as double``."""

    def __init__(self) -> None:
        self.exception = exception
        self.sandboxes: dict[str, _Sandbox] = {}
        self.faults: dict[str, list[BaseException]] = {}
        self.delays: dict[str, float] = {}
        self.calls: list[str] = []
        self.tmp = tempfile.mkdtemp(prefix="modal-double-")
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.App = SimpleNamespace(lookup=self._lookup)
        self.Image = SimpleNamespace(from_registry=lambda tag: SimpleNamespace(tag=tag))
        self.Sandbox = SimpleNamespace(create=self._create)

    def __enter__(self) -> ModalDouble:
        threading.Thread(target=self._expire_loop, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for sid in list(self.sandboxes):
            self._remove(sid)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def inject(self, method: str, error: BaseException, times: int = 1) -> None:
        self.faults.setdefault(method, []).extend([error] * times)

    def live(self) -> list[str]:
        with self.lock:
            return list(self.sandboxes)

    def _maybe_fail(self, method: str) -> None:
        self.calls.append(method)
        time.sleep(self.delays.get(method, 0.0))
        if self.faults.get(method):
            raise self.faults[method].pop(0)

    def _lookup(self, name: str, *, create_if_missing: bool = False) -> SimpleNamespace:
        self._maybe_fail("lookup")
        return SimpleNamespace(name=name)

    def _create(self, *args: str, **kwargs: object) -> _Sandbox:
        self._maybe_fail("create")
        sb = _Sandbox(self, args, kwargs)
        with self.lock:
            self.sandboxes[sb.object_id] = sb
        return sb

    def _remove(self, sid: str) -> None:
        with self.lock:
            sb = self.sandboxes.pop(sid, None)
        if sb is None:
            raise exception.NotFoundError(f"sandbox {sid} not found")
        for p in sb.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        shutil.rmtree(sb.root, ignore_errors=True)

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.1):
            for sid, sb in list(self.sandboxes.items()):
                if sb.deadline <= time.time():
                    try:
                        self._remove(sid)
                    except exception.NotFoundError:
                        pass
