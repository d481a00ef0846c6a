"""The trainer's side of a side-car: start it in its venv, send requests, read answers, stop it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

from miles_agent.envs.external.venv import OFFLINE_ENV
from miles_agent.errors import UserError

SIDECAR = Path(__file__).with_name("sidecar.py")
_LOG_LINES = 40  # side-car stderr lines kept to explain a failure


class SideCarError(RuntimeError):
    """The package side failed a request (its message and the side-car's log tail say why)."""


def side_env(python: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The side-car's environment: ours, offline switches, loopback past any proxy, and the venv's own
    bin/ first on PATH -- the package's tools (Verifiers runs the venv's ``uv``) are found without a
    global install, which a machine may not have."""
    loopback = ",".join(filter(None, ["127.0.0.1,localhost,::1", os.environ.get("NO_PROXY", "")]))
    path = os.pathsep.join(filter(None, [str(Path(python).parent), os.environ.get("PATH", "")]))
    return {**os.environ, **OFFLINE_ENV, "NO_PROXY": loopback, "no_proxy": loopback, "PATH": path, **(extra or {})}


def list_tasks(python: Path, adapter: Path, config: dict[str, Any], timeout_s: float = 300) -> list[dict]:
    """One-shot, synchronous: Environment.tasks() is synchronous and called once per run."""
    name = adapter.stem.removesuffix("_side")
    try:
        done = subprocess.run([str(python), str(SIDECAR), str(adapter), json.dumps(config), "--tasks"],
                              capture_output=True, text=True, timeout=timeout_s, env=side_env(python))
    except subprocess.TimeoutExpired:
        raise UserError(f"{name}: listing tasks took over {timeout_s:g}s (an unbounded taskset?); bound it "
                        "with env.options.num_tasks=N") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if "result" in answer:
        return answer["result"]
    last = next((ln for ln in reversed(done.stderr.splitlines()) if ln.strip()), "")
    cause = answer.get("error") or f"the side-car exited with code {done.returncode}: {last}"
    raise UserError(f"{name}: listing tasks failed: {cause.splitlines()[0][:600]}; fix the env.options "
                    f"that name the environment (docs/ecosystem.md, '{name}')")


class SideCar:
    """A long-lived side-car process; requests are answered concurrently and matched by id."""

    def __init__(self, python: Path, adapter: Path, config: dict[str, Any]) -> None:
        self.argv = [str(python), str(SIDECAR), str(adapter), json.dumps(config)]
        self.python = python
        self.name = adapter.stem
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 1
        self.log: deque[str] = deque(maxlen=_LOG_LINES)
        self._tasks: list[asyncio.Task] = []
        self._ready: asyncio.Future | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.pending[0] = self._ready
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=side_env(self.python), start_new_session=True, limit=2**24)
        self._tasks = [asyncio.ensure_future(self._read_answers()), asyncio.ensure_future(self._read_log())]
        await self._ready

    async def call(self, op: str, timeout_s: float, **args: Any) -> Any:
        if self.proc is None or self.proc.returncode is not None:
            raise SideCarError(f"the {self.name} side-car is not running:\n{self.tail()}")
        rid, self.next_id = self.next_id, self.next_id + 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.proc.stdin.write((json.dumps({"id": rid, "op": op, "args": args}) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self.pending.pop(rid, None)

    def tail(self) -> str:
        return "\n".join(self.log)

    async def _read_answers(self) -> None:
        while line := await self.proc.stdout.readline():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            fut = self.pending.get(msg.get("id"))
            if fut is None or fut.done():
                continue
            if "error" in msg:
                fut.set_exception(SideCarError(f"{self.name}: {msg['error']}"))
            else:
                fut.set_result(msg.get("result"))
        await self.proc.wait()
        for fut in self.pending.values():  # the process died: nobody waits forever
            if not fut.done():
                fut.set_exception(SideCarError(f"the {self.name} side-car exited with code "
                                               f"{self.proc.returncode}:\n{self.tail()}"))

    async def _read_log(self) -> None:
        while line := await self.proc.stderr.readline():
            self.log.append(line.decode(errors="replace").rstrip())

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
