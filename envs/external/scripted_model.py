"""A scripted OpenAI-compatible chat endpoint on loopback, for ``--policy oracle`` inside a side-car.

Standard library only (side-cars never import miles_agent). ``answer(messages) -> str`` writes every
reply; the package's own agent, harness and verifier run unchanged against ``base_url``. Serves
``POST .../chat/completions`` (plain JSON, or server-sent events when the request streams) and
``GET .../models``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid


class ScriptedModel:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.server: asyncio.AbstractServer | None = None
        self.base_url = ""

    async def __aenter__(self) -> ScriptedModel:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self._respond(writer, method, path, json.loads(body) if body else {})
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _respond(self, writer: asyncio.StreamWriter, method: str, path: str, req: dict) -> None:
        if method == "GET" and path.rstrip("/").endswith("/models"):
            return _send(writer, 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
        if not path.rstrip("/").endswith("/chat/completions"):
            return _send(writer, 404, {"error": {"message": f"no route {path}"}})
        text = str(self.answer(req.get("messages") or []))
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.get("model", "policy")
        if not req.get("stream"):
            return _send(writer, 200, {
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})
        chunks = [{"role": "assistant", "content": text}, {}]
        events = "".join("data: " + json.dumps({
            "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": d, "finish_reason": None if d else "stop"}]}) + "\n\n" for d in chunks)
        payload = (events + "data: [DONE]\n\n").encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)


def _send(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
