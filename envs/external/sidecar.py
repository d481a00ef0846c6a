"""The side-car: runs inside a package's own virtual environment and speaks JSON lines over stdio.

Standard library only, and never imports miles_agent: the package's venv has neither (it may even be
another Python). Started as ``python sidecar.py ADAPTER_FILE CONFIG_JSON``; the adapter file defines

    async def tasks(config: dict) -> list[dict]        # [{"id", "prompt", "info"}]
    async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict
                                                       # {"reward": float, "parts": {...}, "info": {...}}
    async def oracle(config: dict, task_id: str) -> dict  # optional: the ecosystem's reference solution

Each request line is ``{"id": n, "op": "tasks" | "episode" | "oracle", "args": {...}}``; each answer is
``{"id": n, "result": ...}`` or ``{"id": n, "error": "..."}``. Requests run concurrently. The real
stdout is kept for the protocol and fd 1 is pointed at stderr, so a package that prints cannot
corrupt the stream.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
import traceback

_DRAIN_S = 10.0  # seconds running requests get to finish after stdin closes


def _protocol_stream():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # print() in the package now goes to stderr
    sys.stdout = sys.stderr
    return proto


def _load(path: str):
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # an adapter may share a helper module
    spec = importlib.util.spec_from_file_location("miles_sidecar_adapter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _serve(adapter, config: dict, proto) -> None:
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read_stdin() -> None:  # a thread: stdin is a pipe, and asyncio pipes are awkward on every OS
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()

    def answer(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")

    async def handle(req: dict) -> None:
        try:
            if req["op"] not in ("tasks", "episode", "oracle") or not hasattr(adapter, req["op"]):
                raise LookupError(f"this adapter serves no {req['op']!r} request")  # the parent checks first
            fn = getattr(adapter, req["op"])
            result = await fn(config, **req.get("args", {}))
            answer({"id": req["id"], "result": result})
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller, named
            traceback.print_exc()
            answer({"id": req.get("id"), "error": f"{type(e).__name__}: {e}"})

    running = set()
    answer({"id": 0, "result": "ready"})
    while (line := await lines.get()) is not None:
        if line.strip():
            job = asyncio.ensure_future(handle(json.loads(line)))
            running.add(job)
            job.add_done_callback(running.discard)
    if running:  # stdin closed (the trainer is gone): let episodes finish briefly, then leave regardless
        _, stuck = await asyncio.wait(running, timeout=_DRAIN_S)
        if stuck:
            os._exit(0)  # a package that never returns must not outlive the trainer


def main() -> None:
    proto = _protocol_stream()
    adapter = _load(sys.argv[1])
    config = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if len(sys.argv) > 3 and sys.argv[3] == "--tasks":  # one-shot listing, for the synchronous tasks()
        try:
            proto.write(json.dumps({"id": 1, "result": asyncio.run(adapter.tasks(config))}) + "\n")
        except Exception as e:  # noqa: BLE001 - one line back to the caller; the traceback stays in the log
            traceback.print_exc()
            proto.write(json.dumps({"id": 1, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    asyncio.run(_serve(adapter, config, proto))


if __name__ == "__main__":
    main()
