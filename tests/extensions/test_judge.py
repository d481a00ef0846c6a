"""miles_agent.envs.judge against a judge server this test starts on loopback: retries on 5xx and timeouts,
fails at once on 4xx, raises an infrastructure error (the episode is retried, never scored 0) when down."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_agent.envs.judge import JudgeError, ask_judge
from miles_agent.errors import InfraError


class Judge(BaseHTTPRequestHandler):
    hits: dict[str, int] = {}
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.bodies.append(body)
        n = Judge.hits[self.path] = Judge.hits.get(self.path, 0) + 1
        if self.path == "/flaky" and n <= 2:
            return self._reply(503, {"error": "warming up"})
        if self.path == "/slow" and n == 1:
            time.sleep(0.6)
        if self.path == "/bad":
            return self._reply(400, {"error": "no answer field"})
        if self.path == "/down":
            return self._reply(500, {})
        if self.path == "/noscore":
            return self._reply(200, {"verdict": "yes"})
        return self._reply(200, {"score": 1.0 if body.get("answer") == "42" else 0.0})

    def _reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.handle_error = lambda *a: None  # the client that timed out on /slow hung up: expected
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def ask(url, **kw):
    return asyncio.run(ask_judge(url, {"answer": kw.pop("answer", "42")}, backoff_s=0.01, **kw))


def test_a_score_is_read_from_the_reply(judge_url):
    assert ask(f"{judge_url}/score") == 1.0
    assert ask(f"{judge_url}/score", answer="41") == 0.0
    assert Judge.bodies[-1] == {"answer": "41"}


def test_5xx_replies_and_timeouts_are_retried(judge_url):
    assert ask(f"{judge_url}/flaky", retries=3) == 1.0 and Judge.hits["/flaky"] == 3
    assert ask(f"{judge_url}/slow", timeout_s=0.2, retries=1) == 1.0 and Judge.hits["/slow"] == 2


def test_a_judge_that_stays_down_is_an_infrastructure_error(judge_url):
    with pytest.raises(JudgeError, match=r"failed 3 times \(last: HTTP 500\)") as e:
        ask(f"{judge_url}/down", retries=2)
    assert isinstance(e.value, InfraError)
    with pytest.raises(JudgeError, match="ConnectError"):
        ask("http://127.0.0.1:9/none", retries=0)


def test_a_4xx_or_a_reply_without_score_fails_at_once(judge_url):
    with pytest.raises(JudgeError, match="refused the request: HTTP 400"):
        ask(f"{judge_url}/bad", retries=3)
    assert Judge.hits["/bad"] == 1
    with pytest.raises(JudgeError, match="without a numeric 'score'"):
        ask(f"{judge_url}/noscore")
