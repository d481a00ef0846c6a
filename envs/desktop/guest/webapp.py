"""The desktop's small local web app (loopback only, standard library): forms whose submissions it records.

Every accepted submission is written to ``RECORDS/<page>.json`` (atomically), which the task's verifier
reads: the form was submitted *to the server* and checked there, not inferred from the screen.

    python3 webapp.py PORT RECORDS_DIR
"""

from __future__ import annotations

import html
import json
import os
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RECORDS = "/var/lib/miles-webapp"
STYLE = ("body{font-family:sans-serif;font-size:16px;margin:24px}label{display:block;margin-top:12px}"
         "input,select,textarea{font-size:16px;margin-top:4px}button{font-size:16px;margin-top:16px;"
         "padding:6px 18px}.item{padding:8px;border:1px solid #888;margin:6px;width:220px;user-select:none}"
         "#box{width:80px;height:80px;background:#36c;position:absolute;left:60px;top:160px;cursor:move}"
         "#target{width:160px;height:160px;border:3px dashed #c33;position:absolute;left:500px;top:120px}")


def record(page: str, data: object) -> None:
    os.makedirs(RECORDS, exist_ok=True)
    path = os.path.join(RECORDS, f"{page}.json")
    with open(path + ".part", "w") as f:
        json.dump(data, f)
    os.replace(path + ".part", path)


def load(page: str, default: object) -> object:
    try:
        with open(os.path.join(RECORDS, f"{page}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def page(title: str, body: str) -> bytes:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>").encode()


def contact() -> bytes:
    return page("Contact us", "<form method='post'><label>Name <input name='name' aria-label='Name'></label>"
                "<label>Email <input name='email' type='email' aria-label='Email'></label>"
                "<label>Message <textarea name='message' aria-label='Message' rows='3'></textarea></label>"
                "<button type='submit'>Send</button></form>")


def newsletter() -> bytes:
    return page("Newsletter", "<form method='post'><label>Email <input name='email' aria-label='Email'></label>"
                "<label><input type='checkbox' name='subscribe' aria-label='Subscribe'> Subscribe</label>"
                "<label>Frequency <select name='frequency' aria-label='Frequency'><option>weekly</option>"
                "<option>monthly</option></select></label><button type='submit'>Join</button></form>")


def settings() -> bytes:
    cur = load("settings", {"theme": "light", "notifications": True, "font_size": "medium"})
    opts = "".join(f"<option{' selected' if cur['theme'] == t else ''}>{t}</option>" for t in ("light", "dark"))
    sizes = "".join(f"<option{' selected' if cur['font_size'] == s else ''}>{s}</option>"
                    for s in ("small", "medium", "large"))
    checked = " checked" if cur["notifications"] else ""
    return page("Settings", f"<form method='post'><label>Theme <select name='theme' aria-label='Theme'>{opts}"
                f"</select></label><label>Font size <select name='font_size' aria-label='Font size'>{sizes}"
                f"</select></label><label><input type='checkbox' name='notifications' aria-label='Notifications'"
                f"{checked}> Notifications</label><button type='submit'>Save</button></form>")


def todo() -> bytes:
    items = "".join(f"<li>{html.escape(i)}</li>" for i in load("todo", []))
    return page("To-do", f"<ul aria-label='Items'>{items}</ul><form method='post'><label>New item "
                "<input name='item' aria-label='New item'></label><button type='submit'>Add</button></form>")


def login() -> bytes:
    return page("Sign in", "<form method='post'><label>Username <input name='username' aria-label='Username'>"
                "</label><label>Password <input name='password' type='password' aria-label='Password'></label>"
                "<button type='submit'>Sign in</button></form>")


def files() -> bytes:
    items = "".join(f"<div class='item' role='listitem' aria-label='{n}' ondblclick=\"openFile('{n}')\">{n}</div>"
                    for n in ("notes.txt", "report.pdf", "photo.png"))
    return page("Files", f"<p>Double-click a file to open it.</p><div role='list'>{items}</div>"
                "<p role='status' id='status'></p><script>function openFile(n){fetch('/files',{method:'POST',"
                "body:'name='+encodeURIComponent(n),headers:{'Content-Type':'application/x-www-form-urlencoded'}})"
                ".then(()=>{document.getElementById('status').textContent='Opened '+n})}</script>")


def drag() -> bytes:
    return page("Drag", "<p>Drag the blue box into the dashed square.</p>"
                "<div id='target' role='region' aria-label='Drop zone'></div>"
                "<div id='box' role='img' aria-label='Blue box'></div><p role='status' id='status'></p>"
                "<script>const b=document.getElementById('box'),t=document.getElementById('target');let d=null;"
                "b.onmousedown=e=>{d=[e.clientX-b.offsetLeft,e.clientY-b.offsetTop];e.preventDefault()};"
                "onmousemove=e=>{if(d){b.style.left=(e.clientX-d[0])+'px';b.style.top=(e.clientY-d[1])+'px'}};"
                "onmouseup=e=>{if(!d)return;d=null;const r=t.getBoundingClientRect(),q=b.getBoundingClientRect();"
                "const inside=q.left>=r.left&&q.right<=r.right&&q.top>=r.top&&q.bottom<=r.bottom;"
                "fetch('/drag',{method:'POST',body:'inside='+inside,headers:{'Content-Type':"
                "'application/x-www-form-urlencoded'}});document.getElementById('status').textContent="
                "inside?'Dropped inside':'Missed'}</script>")


def terms() -> bytes:
    text = "".join(f"<p>Clause {i}: the service is provided as is.</p>" for i in range(1, 41))
    return page("Terms", f"<p>Read the terms, then accept them at the bottom.</p>{text}"
                "<form method='post'><button type='submit'>Accept terms</button></form>")


PAGES = {"contact": contact, "newsletter": newsletter, "settings": settings, "todo": todo, "login": login,
         "files": files, "drag": drag, "terms": terms}


def accept(name: str, form: dict[str, str]) -> None:
    """Record what the page's form submitted, in the shape its verifier reads."""
    if name == "settings":
        record(name, {"theme": form.get("theme", ""), "font_size": form.get("font_size", ""),
                      "notifications": "notifications" in form})
    elif name == "todo":
        if form.get("item", "").strip():
            record(name, [*load("todo", []), form["item"].strip()])
    elif name == "newsletter":
        record(name, {"email": form.get("email", ""), "subscribe": "subscribe" in form,
                      "frequency": form.get("frequency", "")})
    elif name == "login":
        record(name, {"username": form.get("username", ""), "ok": form.get("password") == "hunter2"})
    elif name == "terms":
        record(name, {"accepted": True})
    elif name == "drag":
        record(name, {"inside": form.get("inside") == "true"})
    else:
        record(name, form)


class Handler(BaseHTTPRequestHandler):
    def _name(self) -> str:
        return urllib.parse.urlparse(self.path).path.strip("/") or "contact"

    def do_GET(self) -> None:
        name = self._name()
        if name not in PAGES:
            self.send_error(404)
            return
        body = PAGES[name]()
        if urllib.parse.urlparse(self.path).query == "saved":
            body = body.replace(b"</h1>", b"</h1><p role='status'>Saved</p>", 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        name = self._name()
        if name not in PAGES:
            self.send_error(404)
            return
        size = min(int(self.headers.get("Content-Length") or 0), 1 << 16)
        form = {k: v[-1] for k, v in urllib.parse.parse_qs(self.rfile.read(size).decode(), keep_blank_values=True).items()}
        accept(name, form)
        self.send_response(303)
        self.send_header("Location", f"/{name}?saved")
        self.end_headers()

    def log_message(self, *args: object) -> None:  # quiet: the session keeps its own log
        pass


def main() -> None:
    global RECORDS
    port, RECORDS = int(sys.argv[1]), sys.argv[2]
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
