"""A fake Docker Engine API on 127.0.0.1 that the real ``docker`` SDK talks to over HTTP.

It speaks the endpoints the docker sandbox uses, with the engine's wire formats: JSON bodies, the 101-upgraded
exec stream with 8-byte multiplexing headers, tar archives with the path-stat header, label filters. A
"container" is a temp folder; its main process and its execs are real host subprocesses run in that folder
(container path ``/x`` is ``<folder>/x``), so commands really run, time out and get killed. Faults (429s,
5xx, slow creates) are injected per route to test retries, and ``containers`` tells a test what is left.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


class Container:
    def __init__(self, cid: str, name: str, body: dict, root: str) -> None:
        self.id, self.name, self.body, self.root = cid, name, body, root
        self.main: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.exit_code: int | None = None

    @property
    def labels(self) -> dict:
        return self.body.get("Labels") or {}

    def host_path(self, path: str) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise ValueError(f"path escapes the container: {path}")
        return full

    def kill_all(self) -> None:
        for p in [self.main, *self.procs]:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


class FakeDockerEngine:
    """Start with ``with FakeDockerEngine() as engine:``; point the SDK at ``engine.base_url``."""

    api_version = "1.45"

    def __init__(self) -> None:
        self.containers: dict[str, Container] = {}
        self.execs: dict[str, dict] = {}
        self.images = {"python:3.12-slim"}
        self.image_workdirs: dict[str, str] = {}  # image -> the WORKDIR its config names
        self.faults: dict[str, list[tuple[int, dict]]] = {}  # route name -> responses to give first
        self.delays: dict[str, float] = {}  # route name -> seconds to sleep before handling
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.tmp = tempfile.mkdtemp(prefix="fake-docker-")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.base_url = f"tcp://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeDockerEngine:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        for c in list(self.containers.values()):
            c.kill_all()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def inject(self, route: str, status: int, times: int = 1, message: str = "injected",
               headers: dict | None = None) -> None:
        self.faults.setdefault(route, []).extend([(status, {"message": message, **(headers or {})})] * times)

    def live(self) -> list[str]:
        """Ids of containers that still exist, after their auto-removal has had its moment."""
        with self.lock:
            return list(self.containers)

    def remove(self, cid: str) -> None:
        with self.lock:
            c = self.containers.pop(cid, None)
        if c is not None:
            c.kill_all()
            shutil.rmtree(c.root, ignore_errors=True)

    def _watch_main(self, c: Container) -> None:
        c.exit_code = c.main.wait()
        if (c.body.get("HostConfig") or {}).get("AutoRemove"):
            self.remove(c.id)


ROUTES = [
    ("GET", r"/_ping", "ping"),
    ("GET", r"/version", "version"),
    ("POST", r"/images/create", "pull"),
    ("GET", r"/images/(?P<name>.+)/json", "image_inspect"),
    ("POST", r"/containers/create", "create"),
    ("GET", r"/containers/json", "list"),
    ("GET", r"/containers/(?P<id>[^/]+)/json", "inspect"),
    ("POST", r"/containers/(?P<id>[^/]+)/start", "start"),
    ("POST", r"/containers/(?P<id>[^/]+)/kill", "kill"),
    ("POST", r"/containers/(?P<id>[^/]+)/wait", "wait"),
    ("DELETE", r"/containers/(?P<id>[^/]+)", "remove"),
    ("POST", r"/containers/(?P<id>[^/]+)/exec", "exec_create"),
    ("POST", r"/exec/(?P<id>[^/]+)/start", "exec_start"),
    ("GET", r"/exec/(?P<id>[^/]+)/json", "exec_inspect"),
    ("PUT", r"/containers/(?P<id>[^/]+)/archive", "put_archive"),
    ("GET", r"/containers/(?P<id>[^/]+)/archive", "get_archive"),
]


def _handler(engine: FakeDockerEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _dispatch(self, method: str) -> None:
            url = urlparse(self.path)
            path = re.sub(r"^/v\d+\.\d+", "", url.path)
            self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            self.body = self.rfile.read(length) if length else b""
            for m, pattern, route in ROUTES:
                match = re.fullmatch(pattern, path)
                if m == method and match:
                    engine.calls.append(route)
                    time.sleep(engine.delays.get(route, 0.0))
                    if engine.faults.get(route):
                        status, body = engine.faults[route].pop(0)
                        headers = {k: v for k, v in body.items() if k != "message"}
                        return self._json(status, {"message": body["message"]}, headers)
                    return getattr(self, "do_" + route)(**match.groupdict())
            self._json(404, {"message": f"page not found: {method} {path}"})

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def do_PUT(self) -> None:  # noqa: N802
            self._dispatch("PUT")

        def do_DELETE(self) -> None:  # noqa: N802
            self._dispatch("DELETE")

        # -- plumbing --------------------------------------------------------------------------

        def _send(self, status: int, data: bytes, ctype: str, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Api-Version", engine.api_version)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _json(self, status: int, obj: object, headers: dict | None = None) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json", headers)

        def _container(self, cid: str) -> Container | None:
            with engine.lock:
                c = engine.containers.get(cid)
                if c is None:  # by name, as the engine allows
                    c = next((x for x in engine.containers.values() if x.name == cid), None)
            if c is None:
                self._json(404, {"message": f"No such container: {cid}"})
            return c

        # -- routes ----------------------------------------------------------------------------

        def do_ping(self) -> None:
            self._send(200, b"OK", "text/plain")

        def do_version(self) -> None:
            self._json(200, {"ApiVersion": engine.api_version, "Version": "fake", "MinAPIVersion": "1.24",
                             "Os": "linux", "Arch": "amd64"})

        def do_pull(self) -> None:
            image = f"{self.query['fromImage']}:{self.query.get('tag', 'latest')}"
            engine.images.add(image)
            lines = [{"status": f"Pulling from {self.query['fromImage']}"}, {"status": f"Downloaded {image}"}]
            # The engine streams progress as chunked JSON messages, one per chunk.
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for x in lines:
                data = json.dumps(x).encode() + b"\r\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")

        def do_image_inspect(self, name: str) -> None:
            image = unquote(name) if ":" in unquote(name) else unquote(name) + ":latest"
            if image not in engine.images:
                return self._json(404, {"message": f"No such image: {image}"})
            self._json(200, {"Id": "sha256:" + uuid.uuid5(uuid.NAMESPACE_URL, image).hex, "RepoTags": [image],
                             "Config": {"WorkingDir": engine.image_workdirs.get(image, ""), "Env": []}})

        def do_create(self) -> None:
            body = json.loads(self.body)
            image = body["Image"] if ":" in body["Image"] else body["Image"] + ":latest"
            if image not in engine.images:
                return self._json(404, {"message": f"No such image: {image}"})
            cid = uuid.uuid4().hex + uuid.uuid4().hex
            name = self.query.get("name") or cid[:12]
            root = tempfile.mkdtemp(prefix=cid[:12] + "-", dir=engine.tmp)
            with engine.lock:
                engine.containers[cid] = Container(cid, name, body, root)
            self._json(201, {"Id": cid, "Warnings": []})

        def do_list(self) -> None:
            filters = json.loads(self.query.get("filters", "{}"))
            wanted = filters.get("label", [])
            wanted = list(wanted) if isinstance(wanted, list) else list(wanted.keys())
            out = []
            with engine.lock:
                for c in engine.containers.values():
                    if all(_label_matches(c.labels, w) for w in wanted):
                        out.append({"Id": c.id, "Names": ["/" + c.name], "Image": c.body["Image"],
                                    "Labels": c.labels, "State": "running" if c.main else "created"})
            self._json(200, out)

        def do_inspect(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c:
                running = c.main is not None and c.main.poll() is None
                self._json(200, {"Id": c.id, "Name": "/" + c.name, "Config": {**c.body, "Labels": c.labels},
                                 "HostConfig": c.body.get("HostConfig", {}),
                                 "State": {"Running": running, "ExitCode": c.exit_code or 0}})

        def do_start(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c is None:
                return
            workdir = c.host_path(c.body.get("WorkingDir") or "/")
            os.makedirs(workdir, exist_ok=True)
            c.main = subprocess.Popen(c.body["Cmd"], cwd=workdir, start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            threading.Thread(target=engine._watch_main, args=(c,), daemon=True).start()
            self._send(204, b"", "text/plain")

        def do_kill(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c:
                c.kill_all()
                self._send(204, b"", "text/plain")

        def do_wait(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c:
                code = c.main.wait() if c.main else 0
                self._json(200, {"StatusCode": code, "Error": None})

        def do_remove(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c is None:
                return
            if c.main and c.main.poll() is None and self.query.get("force") not in ("1", "true", "True"):
                return self._json(409, {"message": "You cannot remove a running container. Stop it first"})
            engine.remove(c.id)
            self._send(204, b"", "text/plain")

        def do_exec_create(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c is None:
                return
            if c.main is None or c.main.poll() is not None:
                return self._json(409, {"message": f"Container {id} is not running"})
            eid = uuid.uuid4().hex
            engine.execs[eid] = {"container": c, "body": json.loads(self.body), "exit": None, "running": False}
            self._json(201, {"Id": eid})

        def do_exec_inspect(self, id: str) -> None:  # noqa: A002
            ex = engine.execs.get(id)
            if ex is None:
                return self._json(404, {"message": f"No such exec instance: {id}"})
            self._json(200, {"ID": id, "Running": ex["running"], "ExitCode": ex["exit"],
                             "ContainerID": ex["container"].id})

        def do_exec_start(self, id: str) -> None:  # noqa: A002
            ex = engine.execs.get(id)
            if ex is None:
                return self._json(404, {"message": f"No such exec instance: {id}"})
            c, body = ex["container"], ex["body"]
            env = {"PATH": os.environ["PATH"]}
            env.update(e.split("=", 1) for e in body.get("Env") or [])
            cwd = c.host_path(body.get("WorkingDir") or c.body.get("WorkingDir") or "/")
            # The engine hijacks the connection: a 101, then raw multiplexed frames until the process ends.
            self.wfile.write(b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.multiplexed-stream"
                             b"\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
            self.wfile.flush()
            time.sleep(0.02)  # let the client finish reading the headers before frames arrive
            ex["running"] = True
            try:
                proc = subprocess.Popen(body["Cmd"], cwd=cwd, env=env, start_new_session=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            except OSError as e:
                self._frame(2, f"exec failed: {e}\n".encode())
                ex["exit"], ex["running"] = 126, False
                self.close_connection = True
                return
            c.procs.append(proc)
            write_lock = threading.Lock()

            def pump(pipe: io.BufferedReader, stream: int) -> None:
                for chunk in iter(lambda: pipe.read1(65536), b""):
                    with write_lock:
                        self._frame(stream, chunk)

            pumps = [threading.Thread(target=pump, args=(proc.stdout, 1)),
                     threading.Thread(target=pump, args=(proc.stderr, 2))]
            for t in pumps:
                t.start()
            for t in pumps:
                t.join()
            code = proc.wait()
            ex["exit"], ex["running"] = (code if code >= 0 else 128 - code), False  # the engine's 128+signal
            self.wfile.flush()
            self.close_connection = True

        def _frame(self, stream: int, data: bytes) -> None:
            try:
                self.wfile.write(struct.pack(">BxxxL", stream, len(data)) + data)
            except OSError:
                pass

        def do_put_archive(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c is None:
                return
            dest = c.host_path(self.query["path"])
            if not os.path.isdir(dest):
                return self._json(404, {"message": f"Could not find the file {self.query['path']} in container"})
            with tarfile.open(fileobj=io.BytesIO(self.body)) as tar:
                for m in tar.getmembers():
                    c.host_path(os.path.join(self.query["path"], m.name))  # refuses escapes
                tar.extractall(dest, filter="data")
            self._send(200, b"", "text/plain")

        def do_get_archive(self, id: str) -> None:  # noqa: A002
            c = self._container(id)
            if c is None:
                return
            src = c.host_path(self.query["path"])
            if not os.path.exists(src):
                return self._json(404, {"message": f"Could not find the file {self.query['path']} in container"})
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(src, arcname=os.path.basename(src))
            st = os.stat(src)
            stat = {"name": os.path.basename(src), "size": st.st_size, "mode": st.st_mode, "linkTarget": ""}
            header = base64.b64encode(json.dumps(stat).encode()).decode()
            self._send(200, buf.getvalue(), "application/x-tar", {"X-Docker-Container-Path-Stat": header})

    return Handler


def _label_matches(labels: dict, wanted: str) -> bool:
    key, _, value = wanted.partition("=")
    return key in labels and (not value or labels[key] == value)
