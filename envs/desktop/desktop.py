"""The host's handle on a desktop running inside a sandbox (``guest/session.py``).

The desktop is one long sandbox command (its processes live and die with it); every request is one more
short command that talks to it over its unix socket (``guest/ctl.py``). Works on any backend whose
commands share a filesystem: the local sandbox (a fresh pid and network namespace per command, one
storage) and containers (one machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import uuid
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from miles_agent.sandbox import ExecResult, Sandbox, SandboxError

GUEST_DIR = "/opt/miles-desktop"
GUEST_FILES = ("session.py", "ctl.py", "webapp.py", "fonts.conf")
RECORDS_DIR = "/var/lib/miles-webapp"
WEBAPP_PORT = 8765


def guest_files() -> dict[str, bytes]:
    """The in-sandbox programs, as absolute path -> content for a `SandboxSpec`."""
    root = resources.files("miles_agent.envs.desktop") / "guest"
    return {f"{GUEST_DIR}/{name}": (root / name).read_bytes() for name in GUEST_FILES}


@dataclass
class Observation:
    windows: list[dict[str, Any]]
    a11y: list[dict[str, Any]]
    screenshot: bytes | None = None
    result: str | None = None
    notes: list[str] = field(default_factory=list)


class DesktopError(SandboxError):
    """The desktop could not start or stopped answering: infrastructure, so the episode is retried."""


class Desktop:
    def __init__(self, sandbox: Sandbox, *, width: int = 1024, height: int = 768,
                 lifetime_s: float = 3600.0, start_timeout_s: float = 90.0) -> None:
        self.sandbox = sandbox
        self.width, self.height = width, height
        self.lifetime_s, self.start_timeout_s = lifetime_s, start_timeout_s
        # A per-episode state folder: its name also marks the desktop's processes (leak checks).
        self.state = f"/tmp/.miles-desktop-{uuid.uuid4().hex[:10]}"
        self._run: asyncio.Task[ExecResult] | None = None

    def config(self, launch: list[list[str]], webapp: bool) -> dict[str, Any]:
        return {"display": 1, "width": self.width, "height": self.height, "state": self.state,
                "start_timeout_s": max(10.0, self.start_timeout_s - 10.0),  # the guest's own waits end first
                "launch": launch, "webapp": {"port": WEBAPP_PORT, "records": RECORDS_DIR} if webapp else None}

    async def start(self, launch: list[list[str]], webapp: bool) -> None:
        cfg_path = f"{GUEST_DIR}/config-{self.state.rsplit('-', 1)[1]}.json"
        await self.sandbox.write_file(cfg_path, json.dumps(self.config(launch, webapp)).encode())
        self._run = asyncio.create_task(self.sandbox.exec(
            f"exec python3 {GUEST_DIR}/session.py {cfg_path}", timeout_s=self.lifetime_s))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        probe = f"cat {self.state}/ready {self.state}/failed 2>/dev/null; true"
        while loop.time() < deadline:
            if self._run.done():
                res = self._run.result()
                raise DesktopError(f"desktop: the session exited (code {res.exit_code}) before it was ready: "
                                   f"{(res.stdout + res.stderr).strip()[-600:]}; logs: {await self._logs()}")
            out = (await self.sandbox.exec(probe, timeout_s=30)).stdout.strip()
            if out.startswith("ok"):
                return
            if out:
                raise DesktopError(f"desktop: {out}; logs: {await self._logs()}")
            await asyncio.sleep(0.2)
        raise DesktopError(f"desktop: not ready after {self.start_timeout_s:.0f} s")

    async def _logs(self) -> str:
        logs = await self.sandbox.exec(f"tail -n 5 {self.state}/*.log 2>/dev/null", timeout_s=30)
        return logs.stdout.strip()[-800:]

    async def request(self, req: dict[str, Any], screenshot: bool = True) -> Observation:
        req = {**req, "screenshot": screenshot}
        res = await self.sandbox.exec(f"python3 {GUEST_DIR}/ctl.py {self.state} {shlex.quote(json.dumps(req))}",
                                      timeout_s=120)
        try:
            reply = json.loads(res.stdout)
        except ValueError:
            raise DesktopError(f"desktop: unreadable reply (exit {res.exit_code}): "
                               f"{(res.stdout + res.stderr)[-400:]}") from None
        if "error" in reply:
            raise DesktopError(f"desktop: {reply['error']}")
        png = await self.sandbox.read_file(reply["screenshot"]) if screenshot else None
        notes = [f"accessibility tree unavailable: {reply['a11y_error']}"] if "a11y_error" in reply else []
        return Observation(reply.get("windows", []), reply.get("a11y", []), png, reply.get("result"), notes)

    async def observe(self, screenshot: bool = True) -> Observation:
        return await self.request({"op": "observe"}, screenshot)

    async def act(self, action: dict[str, Any], screenshot: bool = True) -> Observation:
        return await self.request({"op": "act", "action": action}, screenshot)

    async def stop(self) -> None:
        """Ask the session to end its processes, and wait for its command to return."""
        run, self._run = self._run, None
        if run is None:
            return
        if not run.done():
            with contextlib.suppress(Exception):
                await self.sandbox.exec(f"python3 {GUEST_DIR}/ctl.py {self.state} '{{\"op\": \"stop\"}}'",
                                        timeout_s=30)
        try:
            await asyncio.wait_for(asyncio.shield(run), timeout=15)
        except Exception:
            run.cancel()  # the sandbox's stop ends the command's processes with it
            with contextlib.suppress(BaseException):
                await run
