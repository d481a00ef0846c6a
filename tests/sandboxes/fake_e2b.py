"""A fake E2B on 127.0.0.1 that the real ``e2b`` SDK talks to: the REST control plane (``api_url``) and envd,
the in-sandbox daemon (``sandbox_url``).

Control plane: POST /v2/sandboxes, GET /sandboxes/{id}, DELETE /sandboxes/{id}, POST /sandboxes/{id}/timeout,
GET /v2/sandboxes, checking the X-API-KEY header, with faults (429, 5xx) injectable per route. A sandbox's
timeout is enforced here as the service does: when it runs out the sandbox is killed (the dead-man switch).

envd: the ``process.Process`` Connect-RPC service is served by ``connectrpc``'s own WSGI server application
(the same generated service stubs the SDK ships), so the SDK's Connect streaming client is exercised over the
wire; processes are real host subprocesses in the sandbox's temp folder (sandbox path ``/x`` is
``<folder>/x``). Files: GET/POST /files (octet-stream), as envd serves them. Requests are routed to a sandbox
by the ``E2b-Sandbox-Id`` header the SDK sends.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import ProcessSync, ProcessWSGIApplication
from protobuf import Oneof

API_KEY = "e2b_fake_key_for_tests"


class FakeSandbox:
    def __init__(self, sid: str, body: dict, root: str) -> None:
        self.id, self.body, self.root = sid, body, root
        self.end_at = time.time() + int(body.get("timeout") or 300)
        self.procs: dict[int, subprocess.Popen] = {}

    def host_path(self, path: str) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise ValueError(f"path escapes the sandbox: {path}")
        return full

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


class FakeE2B:
    def __init__(self) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.faults: dict[str, list[tuple[int, dict]]] = {}
        self.delays: dict[str, float] = {}
        self.calls: list[str] = []
        self.idempotency: dict[str | None, str] = {}
        self.lock = threading.Lock()
        self.tmp = tempfile.mkdtemp(prefix="fake-e2b-")
        self.api = ThreadingHTTPServer(("127.0.0.1", 0), _api_handler(self))
        self.api.daemon_threads = True
        self.envd = ThreadingHTTPServer(("127.0.0.1", 0), _wsgi_handler(_envd_app(self)))
        self.envd.daemon_threads = True
        self.api_url = f"http://127.0.0.1:{self.api.server_address[1]}"
        self.sandbox_url = f"http://127.0.0.1:{self.envd.server_address[1]}"
        self._stop = threading.Event()

    def __enter__(self) -> FakeE2B:
        for server in (self.api, self.envd):
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        threading.Thread(target=self._expire_loop, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for server in (self.api, self.envd):
            server.shutdown()
            server.server_close()
        for sid in list(self.sandboxes):
            self.kill(sid)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def inject(self, route: str, status: int, times: int = 1, message: str = "injected") -> None:
        self.faults.setdefault(route, []).extend([(status, {"code": status, "message": message})] * times)

    def live(self) -> list[str]:
        with self.lock:
            return list(self.sandboxes)

    def kill(self, sid: str) -> bool:
        with self.lock:
            sb = self.sandboxes.pop(sid, None)
        if sb is None:
            return False
        sb.kill_all()
        shutil.rmtree(sb.root, ignore_errors=True)
        return True

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.1):
            now = time.time()
            for sid, sb in list(self.sandboxes.items()):
                if sb.end_at <= now:
                    self.kill(sid)


# -- control plane (REST) ---------------------------------------------------------------------------

API_ROUTES = [
    ("POST", r"/v2/sandboxes", "create"),
    ("GET", r"/v2/sandboxes", "list"),
    ("GET", r"/sandboxes/(?P<sid>[^/]+)", "get"),
    ("DELETE", r"/sandboxes/(?P<sid>[^/]+)", "kill"),
    ("POST", r"/sandboxes/(?P<sid>[^/]+)/timeout", "timeout"),
]


def _api_handler(fake: FakeE2B) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _dispatch(self, method: str) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            self.body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            for m, pattern, route in API_ROUTES:
                match = re.fullmatch(pattern, url.path)
                if m == method and match:
                    fake.calls.append(route)
                    time.sleep(fake.delays.get(route, 0.0))
                    if self.headers.get("X-API-KEY") != API_KEY:
                        return self._json(401, {"code": 401, "message": "Invalid API key"})
                    if fake.faults.get(route):
                        status, body = fake.faults[route].pop(0)
                        return self._json(status, body)
                    return getattr(self, "do_" + route)(**match.groupdict())
            self._json(404, {"code": 404, "message": f"no route {method} {url.path}"})

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def do_DELETE(self) -> None:  # noqa: N802
            self._dispatch("DELETE")

        def _json(self, status: int, obj: object | None) -> None:
            data = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _info(self, sb: FakeSandbox) -> dict:
            return {"templateID": sb.body.get("templateID", "base"), "sandboxID": sb.id, "clientID": "fake",
                    "envdVersion": "0.6.4", "envdAccessToken": "tok-" + sb.id, "domain": None,
                    "metadata": sb.body.get("metadata") or {}, "state": "running",
                    "endAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(sb.end_at))}

        def do_create(self) -> None:
            key = self.headers.get("Idempotency-Key")
            if key and fake.idempotency.get(key) in fake.sandboxes:  # a replayed create: the same sandbox
                return self._json(201, self._info(fake.sandboxes[fake.idempotency[key]]))
            sid = "i" + uuid.uuid4().hex[:19]
            fake.idempotency[key] = sid
            sb = FakeSandbox(sid, self.body, tempfile.mkdtemp(prefix=sid + "-", dir=fake.tmp))
            with fake.lock:
                fake.sandboxes[sid] = sb
            self._json(201, self._info(sb))

        def do_list(self) -> None:
            with fake.lock:
                self._json(200, [self._info(sb) for sb in fake.sandboxes.values()])

        def do_get(self, sid: str) -> None:
            sb = fake.sandboxes.get(sid)
            if sb is None:
                return self._json(404, {"code": 404, "message": f"sandbox {sid} not found"})
            self._json(200, self._info(sb))

        def do_kill(self, sid: str) -> None:
            if not fake.kill(sid):
                return self._json(404, {"code": 404, "message": f"sandbox {sid} not found"})
            self._json(204, None)

        def do_timeout(self, sid: str) -> None:
            sb = fake.sandboxes.get(sid)
            if sb is None:
                return self._json(404, {"code": 404, "message": f"sandbox {sid} not found"})
            sb.end_at = time.time() + int(self.body["timeout"])
            self._json(204, None)

    return Handler


# -- envd (Connect-RPC process service + files) -----------------------------------------------------

def _wsgi_handler(app) -> type[BaseHTTPRequestHandler]:  # noqa: ANN001
    """A minimal HTTP/1.1 WSGI bridge that, unlike wsgiref, accepts the chunked request bodies a Connect
    streaming client sends; the response streams to the client and the connection closes after it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()

        def _run(self) -> None:
            body = self._body()
            url = urlparse(self.path)
            environ = {"REQUEST_METHOD": self.command, "PATH_INFO": url.path, "QUERY_STRING": url.query,
                       "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                       "SERVER_NAME": "127.0.0.1", "SERVER_PORT": str(self.server.server_address[1]),
                       "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr,
                       "wsgi.url_scheme": "http", "wsgi.version": (1, 0), "wsgi.multithread": True,
                       "wsgi.multiprocess": False, "wsgi.run_once": False}
            for k, v in self.headers.items():
                environ["HTTP_" + k.upper().replace("-", "_")] = v

            def start_response(status: str, headers: list, exc_info: object = None):  # noqa: ANN202
                code, _, reason = status.partition(" ")
                self.send_response(int(code), reason)
                for k, v in headers:
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                return self.wfile.write

            result = app(environ, start_response)
            try:
                for chunk in result:
                    self.wfile.write(chunk)
                    self.wfile.flush()
            finally:
                getattr(result, "close", lambda: None)()
            self.close_connection = True

        do_GET = do_POST = _run

    return Handler


class _ProcessService(ProcessSync):
    """envd's process.Process, the two methods the SDK's commands.run / kill use."""

    def __init__(self, fake: FakeE2B) -> None:
        self.fake = fake

    def _sandbox(self, ctx: object) -> FakeSandbox:
        from connectrpc.code import Code
        from connectrpc.errors import ConnectError

        sid = ctx.request_headers.get("e2b-sandbox-id", "")
        sb = self.fake.sandboxes.get(sid)
        if sb is None:
            raise ConnectError(Code.NOT_FOUND, f"The sandbox {sid} was not found")
        return sb

    def start(self, request: process_pb.StartRequest, ctx: object) -> Iterator[process_pb.StartResponse]:
        sb = self._sandbox(ctx)
        cfg = request.process
        env = {"PATH": os.environ["PATH"], **dict(cfg.envs)}
        cwd = sb.host_path(cfg.cwd or "/")
        args = [a for a in cfg.args if a != "-l"]  # a login shell would read the host's profile
        proc = subprocess.Popen([cfg.cmd, *args], cwd=cwd, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        sb.procs[proc.pid] = proc
        event = process_pb.ProcessEvent
        yield process_pb.StartResponse(event=event(event=Oneof("start", event.StartEvent(pid=proc.pid))))
        chunks: list[tuple[str, bytes]] = []
        cond = threading.Condition()

        def pump(pipe, name: str) -> None:  # noqa: ANN001
            for chunk in iter(lambda: pipe.read1(65536), b""):
                with cond:
                    chunks.append((name, chunk))
                    cond.notify()
            with cond:
                chunks.append((name, b""))
                cond.notify()

        for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            threading.Thread(target=pump, args=(pipe, name), daemon=True).start()
        closed = 0
        while closed < 2:
            with cond:
                cond.wait_for(lambda: chunks)
                batch, chunks[:] = list(chunks), []
            for name, chunk in batch:
                if not chunk:
                    closed += 1
                    continue
                data = event.DataEvent(output=Oneof(name, chunk))
                yield process_pb.StartResponse(event=event(event=Oneof("data", data)))
        code = proc.wait()
        # As envd (Go's ProcessState): a process ended by a signal reports exit code -1, exited false.
        status = f"exit status {code}" if code >= 0 else f"signal: {signal.Signals(-code).name.lower()}"
        end = event.EndEvent(exit_code=code if code >= 0 else -1, exited=code >= 0, status=status)
        yield process_pb.StartResponse(event=event(event=Oneof("end", end)))

    def send_signal(self, request: process_pb.SendSignalRequest, ctx: object) -> process_pb.SendSignalResponse:
        sb = self._sandbox(ctx)
        proc = sb.procs.get(request.process.selector.value)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        return process_pb.SendSignalResponse()


def _envd_app(fake: FakeE2B):  # noqa: ANN202 - a WSGI app
    rpc = ProcessWSGIApplication(_ProcessService(fake))

    def app(environ: dict, start_response):  # noqa: ANN001, ANN202
        path = environ["PATH_INFO"]
        if path.startswith("/process.Process/"):
            fake.calls.append("envd:" + path.rsplit("/", 1)[1])
            return rpc(environ, start_response)
        if path == "/health":
            start_response("204 No Content", [])
            return [b""]
        if path != "/files":
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [json.dumps({"code": 404, "message": "not found"}).encode()]
        fake.calls.append("envd:files:" + environ["REQUEST_METHOD"])
        sb = fake.sandboxes.get(environ.get("HTTP_E2B_SANDBOX_ID", ""))
        query = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}

        def reply(status: str, body: object, ctype: str = "application/json") -> list[bytes]:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(data)))])
            return [data]

        if sb is None:
            return reply("502 Bad Gateway", {"code": 502, "message": "The sandbox was not found"})
        if fake.faults.get("files"):
            status, body = fake.faults["files"].pop(0)
            return reply(f"{status} Injected", body)
        target = sb.host_path(query["path"])
        if environ["REQUEST_METHOD"] == "GET":
            if not os.path.isfile(target):
                return reply("404 Not Found", {"code": 404, "message": f"path '{query['path']}' does not exist"})
            with open(target, "rb") as f:
                return reply("200 OK", f.read(), "application/octet-stream")
        length = int(environ.get("CONTENT_LENGTH") or 0)
        data = environ["wsgi.input"].read(length)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
        return reply("200 OK", [{"name": os.path.basename(target), "type": "file", "path": query["path"]}])

    return app
