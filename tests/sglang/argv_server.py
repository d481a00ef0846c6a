"""A stand-in for ``sglang.launch_server`` that starts in a blink: stdlib HTTP on ``--host/--port``,
``/health_generate`` 200, ``/get_server_info`` echoing its command-line arguments. For the launcher
tests that need processes to supervise, not a model (the full fake is fake_sglang_server.py)."""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/health_generate":
            body = b""
        elif self.path == "/get_server_info":
            body = json.dumps({"argv": args}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


ThreadingHTTPServer((host, port), Handler).serve_forever()
