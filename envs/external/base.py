"""The Environment side of an adapter: tasks and episodes come from a side-car in the package's venv.

An adapter is a side-car script (the real package's API, run in its own venv) plus a small subclass
of `ExternalEnvironment` naming the package pin, the Python it needs and the script. Episodes are
played by the ``external`` harness (`harnesses/external.py`): it opens a proxy session and asks the
session to `play` it -- the package's own agent loop talks to the proxy, which records the tokens,
and the package's own verifier returns the reward that `score` then reports.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, ClassVar

from miles_agent.environment import Environment, EnvSession, Reward, Task
from miles_agent.envs.external.process import SideCar, SideCarError, list_tasks
from miles_agent.envs.external.venv import PackageVenv
from miles_agent.errors import UserError
from miles_agent.sandbox import Sandbox

ADAPTERS = Path(__file__).parent


class ExternalSession(EnvSession):
    """One episode: `play` runs it in the side-car against the proxy; `score` returns its reward."""

    def __init__(self, env: ExternalEnvironment, task: Task) -> None:
        self.env, self.task = env, task
        self.result: dict[str, Any] | None = None

    async def play(self, base_url: str, api_key: str, timeout_s: float) -> dict[str, Any]:
        side = await self.env.sidecar()
        self.result = await side.call("episode", timeout_s, task_id=self.task.id, base_url=base_url,
                                      api_key=api_key)
        return self.result

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        if self.result is None:  # an oracle run (`--policy oracle`) played this task without a session
            self.result = self.env.oracle_results.pop(self.task.id, None)
        if self.result is None:  # the package never finished the episode: nothing it verified
            return Reward(0.0)
        parts = {k: float(v) for k, v in (self.result.get("parts") or {}).items()
                 if isinstance(v, int | float) and not isinstance(v, bool)}
        return Reward(float(self.result["reward"]), parts)


class ExternalEnvironment(Environment):
    """Base of the adapters. Subclasses set the class attributes and, if needed, `side_config`."""

    requirements: ClassVar[tuple[str, ...]] = ()  # pip specifiers of the package's venv
    python: ClassVar[str | None] = None  # "3.12" when the package needs another Python
    adapter_script: ClassVar[str] = ""  # file in envs/external/ run by the side-car
    default_harness: ClassVar[str] = "external"
    options_docs: ClassVar[str] = "docs/ecosystem.md"
    #: What plays ``--policy oracle``: the ecosystem's own reference solution, served by the side-car's
    #: ``oracle``; "" for ecosystems that publish none (OpenEnv, HUD), refused before any episode starts.
    oracle_source: ClassVar[str] = ""
    reward_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)  # the ecosystems bound none

    def __init__(self, **config: Any) -> None:
        self.given = config  # env.options (and --tasks): what the user chose, over side_config's defaults
        self.config = {**self.side_config(), **config}
        packages = tuple(self.config.pop("packages", ()) or ())  # the user's env package, in the same venv
        self.venv = PackageVenv(self.name, (*self.requirements, *packages), self.python)
        self.oracle_results: dict[str, dict[str, Any]] = {}
        self._sidecar: SideCar | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._tasks: list[Task] | None = None

    def side_config(self) -> dict[str, Any]:
        """What the side-car script gets as its ``config`` (JSON)."""
        return {}

    @property
    def script(self) -> Path:
        return ADAPTERS / self.adapter_script

    def tasks(self, split: str = "train") -> list[Task]:
        if self._tasks is None:
            rows = list_tasks(self.venv.ensure(), self.script, self.config)
            self._tasks = [Task(id=str(r["id"]), messages=tuple(r.get("prompt") or ()), info=r.get("info") or {})
                           for r in rows]
        return self._tasks

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> ExternalSession:
        return ExternalSession(self, task)

    async def oracle_solve(self, task: Task, sandbox: Sandbox | None = None) -> None:
        """`--policy oracle`: the ecosystem's own reference solution plays the task in the side-car (Harbor's
        oracle agent, a verifiers task's reference answer); the session opened for it scores that result."""
        side = await self.sidecar()
        try:
            self.oracle_results[task.id] = await side.call("oracle", 900, task_id=task.id)
        except SideCarError as e:
            raise UserError(f"--policy oracle on {self.name}: {str(e).splitlines()[0]}") from None

    async def sidecar(self) -> SideCar:
        """The side-car of the running event loop, started on first use (one per loop: pipes are loop-bound)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._lock, self._sidecar = loop, asyncio.Lock(), None
        async with self._lock:
            if self._sidecar is None or self._sidecar.proc.returncode is not None:
                python = await asyncio.to_thread(self.venv.ensure)
                side = SideCar(python, self.script, self.config)
                await side.start()
                self._sidecar = side
        return self._sidecar

    async def aclose(self) -> None:
        if self._sidecar is not None:
            await self._sidecar.close()
            self._sidecar = None
