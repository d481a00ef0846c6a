"""A fake Daytona on 127.0.0.1 that the real ``daytona`` SDK talks to (``api_url``): the REST control plane
(POST /sandbox, GET/DELETE /sandbox/{idOrName}) and the toolbox API behind the sandbox's
``toolboxProxyUrl`` (POST .../process/execute, POST .../files/bulk-upload multipart), with the
Authorization bearer key checked and faults injectable per route.

Commands are real host subprocesses in the sandbox's temp folder (sandbox path ``/x`` is ``<folder>/x``);
``process/execute`` answers as Daytona's does, stdout and stderr interleaved in ``result``. Lifetimes are
enforced as the service does, with a settable length of a "minute" so tests can watch ``ttlMinutes`` /
auto-stop + auto-delete end a forgotten sandbox.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

API_KEY = "dtn_fake_key_for_tests"


class FakeSandbox:
    def __init__(self, sid: str, body: dict, root: str, minute_s: float) -> None:
        self.id, self.body, self.root = sid, body, root
        ttl = body.get("ttlMinutes") or 0
        self.end_at = time.time() + ttl * minute_s if ttl else float("inf")
        self.procs: list[subprocess.Popen] = []

    def host_path(self, path: str) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise ValueError(f"path escapes the sandbox: {path}")
        return full


class FakeDaytona:
    def __init__(self, minute_s: float = 60.0) -> None:
        self.minute_s = minute_s
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.faults: dict[str, list[tuple[int, str]]] = {}
        self.delays: dict[str, float] = {}
        self.calls: list[str] = []
        self.unknown: list[str] = []  # requests no route matched: the SDK asked for something not faked
        self.lock = threading.Lock()
        self.tmp = tempfile.mkdtemp(prefix="fake-daytona-")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.api_url = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        self._stop = threading.Event()

    def __enter__(self) -> FakeDaytona:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        threading.Thread(target=self._expire_loop, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        for sid in list(self.sandboxes):
            self.delete(sid)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def inject(self, route: str, status: int, times: int = 1, message: str = "injected") -> None:
        self.faults.setdefault(route, []).extend([(status, message)] * times)

    def live(self) -> list[str]:
        with self.lock:
            return list(self.sandboxes)

    def find(self, id_or_name: str) -> FakeSandbox | None:
        with self.lock:
            return self.sandboxes.get(id_or_name) or next(
                (s for s in self.sandboxes.values() if s.body.get("name") == id_or_name), None)

    def delete(self, sid: str) -> bool:
        with self.lock:
            sb = self.sandboxes.pop(sid, None)
        if sb is None:
            return False
        for p in sb.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        shutil.rmtree(sb.root, ignore_errors=True)
        return True

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.1):
            for sid, sb in list(self.sandboxes.items()):
                if sb.end_at <= time.time():
                    self.delete(sid)


ROUTES = [
    ("POST", r"/api/sandbox", "create"),
    ("GET", r"/api/sandbox/(?P<sid>[^/]+)", "get"),
    ("DELETE", r"/api/sandbox/(?P<sid>[^/]+)", "delete"),
    ("POST", r"/toolbox/(?P<sid>[^/]+)/process/execute", "execute"),
    ("POST", r"/toolbox/(?P<sid>[^/]+)/files/bulk-upload", "upload"),
]


def _handler(fake: FakeDaytona) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _dispatch(self, method: str) -> None:
            path = urlparse(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            self.raw = self.rfile.read(length) if length else b""
            for m, pattern, route in ROUTES:
                match = re.fullmatch(pattern, path)
                if m == method and match:
                    fake.calls.append(route)
                    time.sleep(fake.delays.get(route, 0.0))
                    if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                        return self._json(401, {"statusCode": 401, "message": "Unauthorized",
                                                "error": "Unauthorized"})
                    if fake.faults.get(route):
                        status, message = fake.faults[route].pop(0)
                        return self._json(status, {"statusCode": status, "message": message, "error": message})
                    return getattr(self, "do_" + route)(**match.groupdict())
            fake.unknown.append(f"{method} {path}")
            self._json(404, {"statusCode": 404, "message": f"Cannot {method} {path}", "error": "Not Found"})

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def do_DELETE(self) -> None:  # noqa: N802
            self._dispatch("DELETE")

        def _json(self, status: int, obj: object) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _dto(self, sb: FakeSandbox) -> dict:
            b = sb.body
            port = fake.server.server_address[1]
            return {"id": sb.id, "organizationId": "org-fake", "name": b.get("name") or sb.id, "user": "daytona",
                    "env": b.get("env") or {}, "labels": b.get("labels") or {}, "public": False,
                    "networkBlockAll": bool(b.get("networkBlockAll")), "kvm": False, "target": "us", "cpu": 1,
                    "gpu": 0, "memory": 1, "disk": 3, "state": "started", "desiredState": "started",
                    "autoStopInterval": b.get("autoStopInterval"), "autoDeleteInterval": b.get("autoDeleteInterval"),
                    "toolboxProxyUrl": f"http://127.0.0.1:{port}/toolbox"}

        def _sandbox(self, sid: str) -> FakeSandbox | None:
            sb = fake.find(sid)
            if sb is None:
                self._json(404, {"statusCode": 404, "message": f"Sandbox with ID or name {sid} not found",
                                 "error": "Not Found"})
            return sb

        def do_create(self) -> None:
            body = json.loads(self.raw or b"{}")
            sid = uuid.uuid4().hex
            sb = FakeSandbox(sid, body, tempfile.mkdtemp(prefix=sid[:8] + "-", dir=fake.tmp), fake.minute_s)
            with fake.lock:
                fake.sandboxes[sid] = sb
            self._json(200, self._dto(sb))

        def do_get(self, sid: str) -> None:
            sb = self._sandbox(sid)
            if sb:
                self._json(200, self._dto(sb))

        def do_delete(self, sid: str) -> None:
            sb = self._sandbox(sid)
            if sb:
                fake.delete(sb.id)
                self._json(200, self._dto(sb) | {"state": "destroying"})

        def do_execute(self, sid: str) -> None:
            sb = self._sandbox(sid)
            if sb is None:
                return
            req = json.loads(self.raw)
            env = {"PATH": os.environ["PATH"], **(sb.body.get("env") or {}), **(req.get("envs") or {})}
            proc = subprocess.Popen(["bash", "-c", req["command"]], cwd=sb.host_path(req.get("cwd") or "/"),
                                    env=env, start_new_session=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            sb.procs.append(proc)
            try:
                out, _ = proc.communicate(timeout=req.get("timeout") or None)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                return self._json(408, {"statusCode": 408, "message": "command execution timeout",
                                        "error": "Request Timeout"})
            self._json(200, {"exitCode": proc.returncode, "result": out.decode(errors="replace")})

        def do_upload(self, sid: str) -> None:
            sb = self._sandbox(sid)
            if sb is None:
                return
            msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode() + self.raw)
            fields: dict[str, bytes] = {}
            for part in msg.iter_parts():
                fields[part.get_param("name", header="content-disposition")] = part.get_payload(decode=True)
            for key, value in fields.items():
                if key.endswith(".path"):
                    target = sb.host_path(value.decode())
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "wb") as f:
                        f.write(fields[key[: -len(".path")] + ".file"])
            self._json(200, {})

    return Handler
