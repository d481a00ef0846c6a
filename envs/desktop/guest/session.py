"""The desktop inside the sandbox: Xvfb, a window manager, the task's applications, and a control socket.

Runs with the sandbox's own python3 (standard library only) as ONE long-lived command, so that every
process of the desktop lives in that command's process tree (the local sandbox tears down a command's
pid namespace when it returns; a container's exec ends its children here). Each later command reaches
it through the filesystem: X through /tmp/.X11-unix/X<n> (a path socket, shared by every command of the
sandbox, unlike loopback, which the local sandbox gives each command afresh), and this daemon through
``<state>/ctl.sock``. The daemon does the actions (xdotool), the screenshot (Xvfb's ``-fbdir``
framebuffer, an XWD file, encoded to PNG here) and the browser's accessibility tree (Chrome DevTools
protocol over ``--remote-debugging-pipe``: no port, no websocket, no D-Bus).

    python3 session.py CONFIG.json     # {"display", "width", "height", "state", "launch": [...], "webapp": {...}}
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

CHROMIUM_FLAGS = [
    "--no-sandbox",  # the sandbox around us is the boundary; chromium's own needs user namespaces
    "--no-first-run", "--no-default-browser-check", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-features=Translate,MediaRouter", "--password-store=basic", "--disable-sync",
    "--force-renderer-accessibility", "--remote-debugging-pipe", "--window-position=0,0",
]
INTERESTING = {"button", "link", "textbox", "checkbox", "radio", "combobox", "listbox", "option",
               "menuitem", "tab", "slider", "spinbutton", "searchbox", "heading", "StaticText", "img",
               "switch", "listitem", "cell", "LabelText", "paragraph", "status", "alert", "region", "image"}
CLICKABLE = {"button", "link", "textbox", "checkbox", "radio", "combobox", "listbox", "option",
             "menuitem", "tab", "slider", "spinbutton", "searchbox", "switch", "listitem", "img", "image", "cell"}


class Desktop:
    def __init__(self, config: dict) -> None:
        self.cfg = config
        self.state = config["state"]
        self.display = f":{config.get('display', 1)}"
        self.env = {**os.environ, "DISPLAY": self.display, "HOME": os.environ.get("HOME", "/root"),
                    "NO_AT_BRIDGE": "1", "LANG": "C.UTF-8", "XDG_CONFIG_HOME": f"{self.state}/config",
                    # the local sandbox's /etc is an allowlist without fonts/: our own config, found beside us
                    "FONTCONFIG_FILE": os.path.join(os.path.dirname(os.path.abspath(__file__)), "fonts.conf")}
        self.children: list[subprocess.Popen] = []
        self.browser: Cdp | None = None
        self.stopping = threading.Event()
        # One start-up budget (the host's start timeout, less a margin) shared by every wait below, so a
        # loaded machine gets the time the host allows rather than a fixed 10 s per application.
        self.start_deadline = time.time() + float(config.get("start_timeout_s", 60))

    def start_time_left(self, floor: float) -> float:
        return max(floor, self.start_deadline - time.time())

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        os.makedirs(self.state, exist_ok=True)
        w, h = self.cfg.get("width", 1024), self.cfg.get("height", 768)
        num = self.display[1:]
        self.spawn(["Xvfb", self.display, "-screen", "0", f"{w}x{h}x24", "-fbdir", self.state,
                    "-nolisten", "tcp", "-noreset"], log="xvfb")
        wait_for(lambda: os.path.exists(f"/tmp/.X11-unix/X{num}") and self.xdotool("getdisplaygeometry").ok,
                 self.start_time_left(10), "Xvfb did not come up (see xvfb.log)")
        # A window mapped while openbox is still starting is never shown: openbox runs --startup once it
        # manages the screen, and the applications start after that.
        ready = os.path.join(self.state, "wm-ready")
        self.spawn(["openbox", "--sm-disable", "--startup", f"touch {ready}"], log="openbox")
        wait_for(lambda: os.path.exists(ready), self.start_time_left(10), "openbox did not start (openbox.log)")
        time.sleep(0.2)
        webapp = self.cfg.get("webapp")
        if webapp:
            self.spawn([sys.executable, os.path.join(os.path.dirname(__file__), "webapp.py"),
                        str(webapp.get("port", 8765)), webapp["records"]], log="webapp")
            wait_for(lambda: port_open(webapp.get("port", 8765)), self.start_time_left(10),
                     "the web app did not start (webapp.log)")
        for item in self.cfg.get("launch", []):
            if item[0] == "browser":
                self.start_browser(item[1])
            else:
                self.spawn(list(item), log=os.path.basename(item[0]))
        want = len(self.cfg.get("launch", []))
        wait_for(lambda: len(self.windows()) >= want, 20, "")
        if len(self.windows()) < want:
            raise RuntimeError(f"the task's {want} applications did not all open a window: "
                               f"{[w['name'] for w in self.windows()]}; processes: "
                               f"{[(p.args[0], p.poll()) for p in self.children]}")
        time.sleep(float(self.cfg.get("settle_s", 0.5)))

    def spawn(self, argv: list[str], log: str) -> subprocess.Popen:
        out = open(os.path.join(self.state, f"{log}.log"), "ab")
        proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                process_group=0, cwd=self.env["HOME"])
        self.children.append(proc)
        return proc

    def start_browser(self, url: str) -> None:
        # The binary itself, not Debian's /usr/bin/chromium wrapper, which sources /etc/chromium.d (absent
        # in the local sandbox's /etc).
        exe = next((p for p in ("/usr/lib/chromium/chromium",) if os.access(p, os.X_OK)), None) or \
            shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if not exe:
            raise RuntimeError("no chromium in the sandbox (apt-get install chromium)")
        w, h = self.cfg.get("width", 1024), self.cfg.get("height", 768)
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        argv = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={self.state}/chromium", f"--window-size={w},{h}",
                f"--app={url}"]

        def fds() -> None:  # chromium reads commands on fd 3 and answers on fd 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome_r, from_chrome_w)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        out = open(os.path.join(self.state, "chromium.log"), "ab")
        proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                preexec_fn=fds, pass_fds=(3, 4), process_group=0,
                                cwd=self.env["HOME"])
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.children.append(proc)
        self.browser = Cdp(to_chrome_w, from_chrome_r)
        wait_for(lambda: self.browser.page_ready(), self.start_time_left(30), "chromium did not load the task's page")

    # -- actions -------------------------------------------------------------------------------
    def xdotool(self, *args: str) -> Result:
        r = subprocess.run(["xdotool", *args], env=self.env, capture_output=True, text=True, timeout=20)
        return Result(r.returncode == 0, r.stdout, r.stderr)

    def act(self, a: dict) -> str:
        kind = a["action"]
        x, y = str(int(a.get("x", 0))), str(int(a.get("y", 0)))
        if kind in ("click", "double_click"):
            button = {"left": "1", "middle": "2", "right": "3"}[a.get("button", "left")]
            self.xdotool("mousemove", x, y)
            time.sleep(0.05)
            repeat = ["--repeat", "2", "--delay", "80"] if kind == "double_click" else []
            r = self.xdotool("click", *repeat, button)
        elif kind == "type":
            r = self.xdotool("type", "--delay", "8", "--", a["text"])
        elif kind == "key":
            r = self.xdotool("key", "--delay", "30", "--", *a["keys"].split())
        elif kind == "scroll":
            self.xdotool("mousemove", x, y)
            button = {"up": "4", "down": "5", "left": "6", "right": "7"}[a.get("direction", "down")]
            r = self.xdotool("click", "--repeat", str(int(a.get("amount", 3))), "--delay", "30", button)
        elif kind == "drag":
            x2, y2 = int(a["x2"]), int(a["y2"])
            self.xdotool("mousemove", x, y)
            time.sleep(0.05)
            self.xdotool("mousedown", "1")
            steps = 8
            for i in range(1, steps + 1):  # intermediate moves: pages see a drag, not a teleport
                self.xdotool("mousemove", str(int(x) + (x2 - int(x)) * i // steps),
                             str(int(y) + (y2 - int(y)) * i // steps))
                time.sleep(0.02)
            r = self.xdotool("mouseup", "1")
        elif kind == "wait":
            time.sleep(min(float(a.get("seconds", 1.0)), 10.0))
            r = Result(True, "", "")
        else:
            raise ValueError(f"unknown action {kind!r}")
        time.sleep(float(self.cfg.get("action_settle_s", 0.3)))
        return "ok" if r.ok else f"xdotool failed: {r.err.strip()[:200]}"

    # -- observations --------------------------------------------------------------------------
    def windows(self) -> list[dict]:
        found = self.xdotool("search", "--onlyvisible", "--name", ".")
        active = self.xdotool("getactivewindow").out.strip()
        out = []
        for wid in found.out.split():
            name = self.xdotool("getwindowname", wid).out.strip()
            geo = dict(line.split("=", 1) for line in self.xdotool("getwindowgeometry", "--shell", wid)
                       .out.split() if "=" in line)
            if not name or int(geo.get("WIDTH", 0)) < 20:
                continue
            out.append({"id": wid, "name": name, "x": int(geo.get("X", 0)), "y": int(geo.get("Y", 0)),
                        "w": int(geo.get("WIDTH", 0)), "h": int(geo.get("HEIGHT", 0)), "focused": wid == active})
        return out

    def observe(self, screenshot: bool) -> dict:
        obs: dict = {"windows": self.windows(), "a11y": []}
        if self.browser is not None:
            try:
                obs["a11y"] = self.browser.ax_nodes()
            except Exception as e:  # a page mid-navigation: the next observation has it
                obs["a11y_error"] = str(e)[:200]
        if screenshot:
            path = os.path.join(self.state, "screen.png")
            with open(path + ".part", "wb") as f:
                f.write(framebuffer_png(os.path.join(self.state, "Xvfb_screen0")))
            os.replace(path + ".part", path)
            obs["screenshot"] = path
        return obs

    # -- control socket ------------------------------------------------------------------------
    def serve(self) -> None:
        path = os.path.join(self.state, "ctl.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(8)
        srv.settimeout(0.5)
        print(json.dumps({"ready": True}), flush=True)
        with open(os.path.join(self.state, "ready"), "w") as f:
            f.write("ok\n")
        while not self.stopping.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(60)
                try:
                    reply = self.handle(json.loads(read_all(conn)))
                except Exception as e:
                    reply = {"error": f"{type(e).__name__}: {e}"}
                conn.sendall(json.dumps(reply).encode())
        srv.close()

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "stop":
            self.stopping.set()
            return {"stopped": True}
        if op == "ping":
            return {"ok": True}
        result = self.act(req["action"]) if op == "act" else None
        obs = self.observe(bool(req.get("screenshot", True)))
        return {"result": result, **obs}

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in reversed(self.children):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 3
            while time.time() < deadline and any(p.poll() is None for p in self.children):
                time.sleep(0.05)


class Result:
    def __init__(self, ok: bool, out: str, err: str) -> None:
        self.ok, self.out, self.err = ok, out, err


class Cdp:
    """The Chrome DevTools protocol over chromium's pipe: NUL-separated JSON messages."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.w, self.r = write_fd, os.fdopen(read_fd, "rb", buffering=0)
        self.next_id = 0
        self.replies: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.session = ""
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        buf = b""
        while True:
            chunk = self.r.read(65536)
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                data = json.loads(msg)
                if "id" in data:
                    with self.cond:
                        self.replies[data["id"]] = data
                        self.cond.notify_all()

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 10.0) -> dict:
        with self.cond:
            self.next_id += 1
            mid = self.next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session or (session is None and self.session):
            msg["sessionId"] = session or self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        with self.cond:
            while mid not in self.replies:
                if not self.cond.wait(max(0.0, deadline - time.time())):
                    raise TimeoutError(f"devtools: no reply to {method}")
            reply = self.replies.pop(mid)
        if "error" in reply:
            raise RuntimeError(f"devtools {method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def page_ready(self) -> bool:
        pages = [t for t in self.call("Target.getTargets", session="")["targetInfos"] if t["type"] == "page"]
        if not pages:
            return False
        if not self.session:
            self.session = self.call("Target.attachToTarget", {"targetId": pages[0]["targetId"],
                                                               "flatten": True}, session="")["sessionId"]
            self.call("Accessibility.enable")
            self.call("DOM.enable")
        state = self.call("Runtime.evaluate", {"expression": "document.readyState", "returnByValue": True})
        return state.get("result", {}).get("value") == "complete"

    def ax_nodes(self) -> list[dict]:
        """The page's accessibility tree, flattened to named nodes with screen coordinates."""
        geo = self.call("Runtime.evaluate", {"returnByValue": True, "expression":
                        "[window.screenX, window.screenY, window.outerHeight - window.innerHeight,"
                        " window.outerWidth - window.innerWidth]"})["result"]["value"]
        off_x, off_y = geo[0] + geo[3] // 2, geo[1] + geo[2]
        nodes = self.call("Accessibility.getFullAXTree")["nodes"]
        by_id = {n["nodeId"]: n for n in nodes}
        depth: dict[str, int] = {}
        out = []
        for n in nodes:
            parent = n.get("parentId")
            depth[n["nodeId"]] = depth.get(parent, -1) + 1 if parent else 0
            if n.get("ignored"):
                continue
            role = n.get("role", {}).get("value", "")
            name = str(n.get("name", {}).get("value", "")).strip()
            if role not in INTERESTING or (not name and role not in CLICKABLE):
                continue
            if role == "StaticText" and by_id.get(parent, {}).get("role", {}).get("value") in CLICKABLE:
                continue  # the text of a button or link is the button's name already
            node = {"role": role, "name": name, "depth": depth[n["nodeId"]]}
            if "value" in n and n["value"].get("value") not in (None, ""):
                node["value"] = str(n["value"]["value"])
            for prop in n.get("properties", []):
                if prop["name"] in ("checked", "focused", "disabled", "selected", "expanded"):
                    node[prop["name"]] = prop["value"].get("value")
            box = self._box(n.get("backendDOMNodeId"))
            if box is None:
                continue
            x, y, w, h = box
            node.update(x=x + off_x, y=y + off_y, w=w, h=h)
            out.append(node)
        return out

    def _box(self, backend_id: int | None) -> tuple[int, int, int, int] | None:
        if backend_id is None:
            return None
        try:
            quad = self.call("DOM.getBoxModel", {"backendNodeId": backend_id})["model"]["border"]
        except RuntimeError:
            return None  # not rendered (display: none, off-DOM text)
        xs, ys = quad[0::2], quad[1::2]
        w, h = int(max(xs) - min(xs)), int(max(ys) - min(ys))
        return (int(min(xs)), int(min(ys)), w, h) if w > 0 and h > 0 else None


def framebuffer_png(path: str) -> bytes:
    """Xvfb's -fbdir screen (an XWD dump, 32 bits per pixel) as an RGB PNG."""
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack(">25I", data[:100])
    header_size, width, height, byte_order = header[0], header[4], header[5], header[7]
    bpp, line, ncolors = header[11], header[12], header[19]
    if bpp != 32:
        raise RuntimeError(f"framebuffer has {bpp} bits per pixel, expected 32")
    pixels = data[header_size + 12 * ncolors:][: line * height]
    rows = []
    for y in range(height):
        row = pixels[y * line: y * line + 4 * width]
        rgb = bytearray(3 * width)
        if byte_order == 0:  # LSB first: B G R X in memory
            rgb[0::3], rgb[1::3], rgb[2::3] = row[2::4], row[1::4], row[0::4]
        else:
            rgb[0::3], rgb[1::3], rgb[2::3] = row[1::4], row[2::4], row[3::4]
        rows.append(b"\0" + bytes(rgb))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
            + chunk(b"IEND", b""))


def read_all(conn: socket.socket) -> bytes:
    parts = []
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_for(check, timeout_s: float, message: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    if message:
        raise RuntimeError(message)


def main() -> int:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    desktop = Desktop(config)
    signal.signal(signal.SIGTERM, lambda *_: desktop.stopping.set())
    try:
        desktop.start()
        desktop.serve()
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        with open(os.path.join(config["state"], "failed"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        return 1
    finally:
        desktop.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
