"""The HTTP face of the proxy (aiohttp): OpenAI routes per session, each guarded by the session's own key.

Routes, all under ``/sessions/{id}``:

* ``GET v1/models``, ``POST v1/chat/completions``, ``POST v1/completions`` -- the OpenAI API;
* ``GET env/task``, ``POST env/tools/call`` -- the episode's task and tools, when the session has a
  `ToolHost` (the black-box harness gives one, so an agent program can act in the environment).

An unknown session is 404, a missing or wrong key 401: a key opens only its own session, so one episode
can neither read nor write another's. The server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from miles_agent.engine import Policy, SamplingParams
from miles_agent.environment import ToolError
from miles_agent.errors import require
from miles_agent.harnesses.proxy import responses
from miles_agent.harnesses.proxy.history import ProxyLimits
from miles_agent.harnesses.proxy.protocol import (
    ProxyError,
    bad_request,
    parse_chat_request,
    parse_completion_request,
)
from miles_agent.harnesses.proxy.session import Session, ToolHost

log = logging.getLogger(__name__)

_MAX_BODY = 64 << 20  # agents resend their whole history on every call


class ProxyServer:
    """An OpenAI-compatible endpoint in front of ``engine`` (any `Policy`), one session per episode.

    ``sampling`` is the base of every request's sampling (stop ids of the tokenizer are always added);
    with ``honor_client_sampling=False`` the client's temperature/top_p/top_k/seed are ignored, as training
    needs (the trainer's logprobs assume the rollout temperature). ``max_tokens`` is always capped by
    ``limits.max_new_tokens_per_turn``. With ``return_routed_experts`` (MoE) each branch's trajectory carries
    the routing of its latest call, which covers every token of the branch (R3 replay).
    Use as ``async with ProxyServer(engine, tokenizer) as server``.
    """

    def __init__(self, engine: Policy, tokenizer: Any, *, host: str = "127.0.0.1", port: int = 0,
                 sampling: SamplingParams | None = None, limits: ProxyLimits | None = None,
                 honor_client_sampling: bool = True, model_name: str = "miles-policy",
                 return_routed_experts: bool = False) -> None:
        from miles_agent.models.tokenizer import stop_token_ids

        self.engine, self.tokenizer, self.host, self.port = engine, tokenizer, host, port
        base = sampling or SamplingParams()
        stops = tuple(sorted(set(base.stop_token_ids) | set(stop_token_ids(tokenizer))))
        self.sampling = replace(base, stop_token_ids=stops)
        self.limits = limits or ProxyLimits()
        self.honor_client_sampling = honor_client_sampling
        self.model_name = model_name
        self.return_routed_experts = return_routed_experts  # MoE: record routing for R3 replay
        self.sessions: dict[str, Session] = {}
        self._deadlines: dict[str, float] = {}  # session id -> monotonic time it stops serving
        self._runner: Any = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        web = require("aiohttp.web", "proxy", "The OpenAI-compatible proxy")
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("proxy listening on %s: reachable beyond this machine; sessions are key-protected", self.host)
        app = web.Application(client_max_size=_MAX_BODY, middlewares=[_json_errors(web)])
        r = app.router
        r.add_get("/sessions/{sid}/v1/models", self._guard(self._models))
        r.add_post("/sessions/{sid}/v1/chat/completions", self._guard(self._chat))
        r.add_post("/sessions/{sid}/v1/completions", self._guard(self._completions))
        r.add_get("/sessions/{sid}/env/task", self._guard(self._env_task))
        r.add_post("/sessions/{sid}/env/tools/call", self._guard(self._env_call))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.sessions.clear()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- sessions -------------------------------------------------------------------------------------
    def open_session(self, *, policy: Policy | None = None, limits: ProxyLimits | None = None,
                     tool_host: ToolHost | None = None, ttl_s: float | None = None) -> Session:
        """A new episode endpoint with its own secret; ``policy`` overrides the server's engine for it.

        ``ttl_s``: the session stops serving that many seconds after opening (404), so an owner that never
        closes it cannot leak it in a long-lived server.
        """
        if self._runner is None:
            raise RuntimeError("start the ProxyServer (async with ProxyServer(...)) before opening sessions")
        sid = uuid.uuid4().hex
        session = Session(session_id=sid, base_url=f"{self.url}/sessions/{sid}/v1", policy=policy or self.engine,
                          tokenizer=self.tokenizer, limits=limits or self.limits, sampling=self.sampling,
                          honor_client_sampling=self.honor_client_sampling, tool_host=tool_host,
                          return_routed_experts=self.return_routed_experts)
        self._reap()
        self.sessions[sid] = session
        if ttl_s is not None:
            self._deadlines[sid] = time.monotonic() + ttl_s
        return session

    def _reap(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, t in self._deadlines.items() if t <= now]:
            self._deadlines.pop(sid)
            if sid in self.sessions:
                self.close_session(self.sessions[sid])

    def close_session(self, session: Session) -> None:
        """Stop serving a session (its trajectories stay readable on the object)."""
        session.closed = True
        self.sessions.pop(session.id, None)
        self._deadlines.pop(session.id, None)

    # -- handlers -------------------------------------------------------------------------------------
    def _guard(self, handler: Callable[[Session, Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        async def guarded(request: Any) -> Any:
            from aiohttp import web

            try:
                return await handler(self._authorize(request), request)
            except ProxyError as e:
                headers = {} if e.retry else {"x-should-retry": "false"}
                return web.json_response(e.body(), status=e.status, headers=headers)
        return guarded

    def _authorize(self, request: Any) -> Session:
        self._reap()
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise ProxyError(404, "no such session (it was never opened, or its episode has ended)",
                             code="session_not_found")
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ProxyError(401, "missing API key: send 'Authorization: Bearer <the session's api_key>'",
                             code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), session.api_key.encode()):
            raise ProxyError(401, "incorrect API key for this session", code="invalid_api_key")
        return session

    async def _models(self, session: Session, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles-agent"}]})

    async def _chat(self, session: Session, request: Any) -> Any:
        req = parse_chat_request(await _body(request))
        return await self._reply(request, req, await session.chat(req), responses.chat_completion,
                                 responses.chat_chunks)

    async def _completions(self, session: Session, request: Any) -> Any:
        req = parse_completion_request(await _body(request))
        return await self._reply(request, req, await session.complete(req), responses.text_completion,
                                 responses.text_chunks)

    async def _reply(self, request: Any, req: Any, turn: Any, whole: Any, chunks: Any) -> Any:
        """One finished turn as a JSON body, or replayed as SSE chunks when the client asked to stream."""
        model = req.model or self.model_name
        if req.stream:
            return await _stream(request, chunks(turn, model, req.logprobs, req.include_usage, self.tokenizer))
        from aiohttp import web

        return web.json_response(whole(turn, model, req.logprobs, self.tokenizer), dumps=_dumps)

    async def _env_task(self, session: Session, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(_tool_host(session).describe(), dumps=_dumps)

    async def _env_call(self, session: Session, request: Any) -> Any:
        from aiohttp import web

        host, body = _tool_host(session), await _body(request)
        name, args = body.get("name") if isinstance(body, dict) else None, (body or {}).get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            raise bad_request('send {"name": TOOL, "arguments": {...}} (arguments an object or its JSON text)')
        try:
            return web.json_response({"content": await host.call(name, args), "is_error": False}, dumps=_dumps)
        except ToolError as e:  # the model's mistake: shown to it, not an HTTP failure
            return web.json_response({"content": f"error: {e}", "is_error": True}, dumps=_dumps)


def _tool_host(session: Session) -> ToolHost:
    if session.tool_host is None:
        raise ProxyError(404, "this session has no environment tools", code="no_environment")
    return session.tool_host


async def _body(request: Any) -> Any:
    try:
        return json.loads(await request.read() or b"null")
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None


async def _stream(request: Any, chunks: Any) -> Any:
    from aiohttp import web

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _json_errors(web: Any) -> Any:
    """Unknown routes and methods answer with OpenAI-shaped JSON errors too."""
    @web.middleware
    async def middleware(request: Any, handler: Any) -> Any:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ProxyError(e.status, f"{request.method} {request.path}: {e.reason}; the OpenAI routes are "
                             "/sessions/{id}/v1/chat/completions and /sessions/{id}/v1/completions")
            return web.json_response(err.body(), status=e.status)
    return middleware
