"""desktop: computer-use tasks on a real X desktop inside the sandbox, scored by programmatic verifiers.

Each episode starts a desktop in its sandbox (Xvfb, openbox, the task's applications: the st terminal,
the mousepad editor, chromium on a small web app served on the sandbox's loopback), gives the model mouse
and keyboard tools (`actions.TOOLS`), and after every action returns what the screen shows: a PNG
screenshot (`DesktopSession.screenshots`, for vision policies and the report) and, as the tool result's
text, the windows and the browser's accessibility tree with on-screen coordinates, so a text-only policy
plays the same tasks. The verifier reads the state the agent left -- a file's content, the web app's
record of a submitted form, a saved setting -- per the task's OSWorld-style evaluator (`tasks`).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from miles_agent.environment import Environment, EnvSession, Reward, Task
from miles_agent.errors import UserError
from miles_agent.sandbox import ImageBuild, Sandbox, SandboxError, SandboxLimits, SandboxSpec

from .actions import TOOLS, a11y_text, find_target, parse_action
from .desktop import Desktop, Observation, guest_files
from .tasks import DesktopTask, judge, load_tasks

log = logging.getLogger(__name__)
IMAGE_DIR = Path(__file__).parent / "image"
SYSTEM_PROMPT = ("You operate a Linux desktop with the mouse and keyboard tools. Coordinates are screen pixels; "
                 "each tool returns the screen's windows and accessibility tree. When the task is done, "
                 "reply without a tool call.")
# Chromium reserves far more address space than it uses, and a desktop runs for the whole episode.
DESKTOP_LIMITS = SandboxLimits(wall_time_s=120.0, cpu_time_s=3600, memory_bytes=1 << 40, max_processes=512,
                               max_open_files=4096, disk_bytes=2 << 30, disk_inodes=262144)


@dataclass(frozen=True)
class DesktopOptions:
    """``env.options`` of the desktop env."""

    tasks_dir: str = ""  # a folder of OSWorld-style task JSON files ("" = the shipped tasks)
    width: int = 1024
    height: int = 768
    image: str = ""  # container backends: a prebuilt desktop image ("" = build envs/desktop/image)
    episode_s: float = 1800.0  # how long the desktop may live
    max_a11y_nodes: int = 80  # accessibility-tree lines in one observation
    screenshots: bool = True  # keep each observation's PNG on the session (vision policies, the report)


class DesktopSession(EnvSession):
    tools = TOOLS

    def __init__(self, task: DesktopTask, sandbox: Sandbox, desktop: Desktop, opts: DesktopOptions) -> None:
        self.task, self.sandbox, self.desktop, self.opts = task, sandbox, desktop, opts
        self.screenshots: list[bytes] = []
        self.last: Observation | None = None
        self.actions: list[dict[str, Any]] = []

    def _keep(self, obs: Observation) -> Observation:
        self.last = obs
        if obs.screenshot is not None and self.opts.screenshots:
            self.screenshots.append(obs.screenshot)
        return obs

    async def observe(self) -> Observation:
        return self._keep(await self.desktop.observe(self.opts.screenshots))

    def describe(self, obs: Observation) -> str:
        return a11y_text(obs, self.opts.width, self.opts.height, self.opts.max_a11y_nodes)

    async def opening_text(self) -> str:
        """The screen before the first action, as the text a policy reads."""
        return self.describe(self.last or await self.observe())

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        action = parse_action(name, arguments, self.opts.width, self.opts.height)
        obs = self._keep(await self.desktop.act(action, self.opts.screenshots))
        self.actions.append(action)
        head = "" if obs.result == "ok" else f"{obs.result}\n"
        return head + self.describe(obs)

    async def play_oracle(self) -> None:
        """The task's scripted solution, each ``target`` resolved against the current accessibility tree."""
        for step in self.task.oracle:
            args = {k: v for k, v in step.items() if k not in ("tool", "target", "target2")}
            for key, (kx, ky) in (("target", ("x", "y")), ("target2", ("x2", "y2"))):
                if key in step:
                    x, y = find_target(self.last or await self.observe(), step[key])
                    args[kx], args[ky] = x + step.get("dx", 0) * (key == "target"), y + step.get("dy", 0) * (key == "target")
            await self.call_tool(step["tool"], args)

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        await self.desktop.stop()  # the applications have written what they will; nothing acts after this
        parts = {}
        for i, check in enumerate(self.task.checks):
            parts[f"{check.func}_{i}"] = judge(check, await self._result_text(check.result))
        values = list(parts.values())
        value = float(all(values) if self.task.conj == "and" else any(values))
        return Reward(value, {**parts, "actions": float(len(self.actions))})

    async def _result_text(self, result: dict[str, Any]) -> str:
        if result["type"] == "vm_file":
            # A missing file is the agent's failure (""), on every backend (they word it differently).
            if (await self.sandbox.exec(f"test -f {shlex.quote(result['path'])}", timeout_s=60)).exit_code != 0:
                return ""
            try:
                return (await self.sandbox.read_file(result["path"])).decode(errors="replace")
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                return ""
            except SandboxError:
                raise
            except OSError:
                return ""
        res = await self.sandbox.exec(result["command"], timeout_s=60)
        return res.stdout

    async def close(self) -> None:
        await self.desktop.stop()


class DesktopEnv(Environment):
    name: ClassVar[str] = "desktop"
    description: ClassVar[str] = ("Computer use on an X desktop in the sandbox (terminal, editor, browser + local web "
                                  "app): screenshots and an accessibility tree, mouse/keyboard tools, OSWorld-style tasks")
    needs_sandbox: ClassVar[bool] = True
    env_keys: ClassVar[tuple[str, ...]] = ("sandbox",)
    options_type: ClassVar[type] = DesktopOptions

    def __init__(self, *, sandbox: str = "local", **options: Any) -> None:
        self.sandbox = sandbox
        self.opts = DesktopOptions(**options)
        if self.opts.width < 320 or self.opts.height < 240:
            raise UserError(f"desktop: screen {self.opts.width}x{self.opts.height} is too small; use at least 320x240")
        self._tasks = {t.id: t for t in load_tasks(self.opts.tasks_dir or None)}

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in ("train", "eval", "test"):
            raise ValueError(f"unknown split {split!r}; use train, eval or test")
        return [Task(id=t.id, messages=({"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": t.instruction}), info={"apps": t.related_apps})
                for t in self._tasks.values()]

    def desktop_task(self, task_id: str) -> DesktopTask:
        return self._tasks[task_id]

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        t = self._tasks[task.id]
        spec = SandboxSpec(files={**guest_files(), **t.files}, limits=DESKTOP_LIMITS,
                           env={"HOME": "/root"})
        if self.sandbox not in ("local",):  # a container: the desktop's applications come with its image
            if self.opts.image:
                spec.image = self.opts.image
            else:
                spec.build = ImageBuild(context=str(IMAGE_DIR))
        return spec

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        if sandbox is None:
            raise UserError("desktop: the env needs a sandbox (env.sandbox=local or docker)")
        t = self._tasks[task.id]
        for command in t.setup:
            res = await sandbox.exec(command, timeout_s=120)
            if res.exit_code != 0:
                raise SandboxError(f"desktop: task {t.id}'s setup `{command[:80]}` failed (exit {res.exit_code}): "
                                   f"{(res.stdout + res.stderr)[-300:]}")
        desktop = Desktop(sandbox, width=self.opts.width, height=self.opts.height, lifetime_s=self.opts.episode_s)
        await desktop.start([list(item) for item in t.launch], t.webapp)
        session = DesktopSession(t, sandbox, desktop, self.opts)
        try:
            await session.observe()
        except BaseException:
            await desktop.stop()
            raise
        return session
