"""A fake sglang_router for the tests: ``POST /add_worker?url=``, ``POST /remove_worker?url=`` and
``/generate`` forwarded round-robin to the registered workers. Runs in a thread with its own loop,
because the launcher registers servers with blocking calls."""

from __future__ import annotations

import asyncio
import itertools
import threading

import aiohttp
from aiohttp import web


class FakeRouter:
    def __init__(self) -> None:
        self.workers: list[str] = []
        self.forwarded: dict[str, int] = {}
        self.events: list[tuple[str, str]] = []
        self._rr = itertools.count()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/add_worker", self.add)
        app.router.add_post("/remove_worker", self.remove)
        app.router.add_post("/generate", self.generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()

    async def add(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if not url:
            return web.Response(status=400, text="url is required")
        self.events.append(("add", url))
        if url not in self.workers:
            self.workers.append(url)
        return web.Response(text=f"Successfully added worker: {url}")

    async def remove(self, request: web.Request) -> web.Response:
        url = request.query.get("url", "")
        self.events.append(("remove", url))
        if url in self.workers:
            self.workers.remove(url)
        return web.Response(text=f"Successfully removed worker: {url}")

    async def generate(self, request: web.Request) -> web.Response:
        if not self.workers:
            return web.Response(status=503, text="No available workers")
        worker = self.workers[next(self._rr) % len(self.workers)]
        self.forwarded[worker] = self.forwarded.get(worker, 0) + 1
        async with aiohttp.ClientSession() as s, s.post(f"{worker}/generate", data=await request.read(),
                                                        headers={"Content-Type": "application/json"}) as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    def close(self) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
