"""terminal-bench: Harbor-format shell tasks, played through one `bash` tool and scored by the task's test.sh.

Paths. Harbor's scripts use absolute paths: the verifier writes /logs/verifier/reward.txt, its
helpers live in /tests, the oracle in /solution, and the agent works in the task's working
directory (WORKDIR). Every sandbox shows them at those real paths -- the local one in its mount
namespace -- so task scripts run unmodified (``APP_DIR="${APP_DIR:-/app}"`` and computed paths
work). The verifier runs through `Sandbox.run_verifier`, which puts tests/ at /tests and a fresh
/logs/verifier in every sandbox -- from the host side on the local one, where the agent cannot
reach them -- with a fresh home and /tmp and Python without user site. tests/ is never in the
sandbox while the agent acts; the oracle's solution/ is put at /solution before solve.sh runs.
On the local sandbox, the Dockerfile's RUN steps that need only host tools run first (`run_setup`).

Failures: a missing or garbled reward file, a verifier that times out, or one that cannot be set up
because of the state the agent left (a locked folder, a full disk), is the agent's failure and scores
0 with a part saying which; a `SandboxError` is an infrastructure failure and propagates (the
episode is retried, never scored 0).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shlex
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.errors import UserError
from miles_agent.sandbox import (
    ExecResult,
    ImageBuild,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    VerifierRun,
)

from .harbor import HarborTask, load_tasks, staged_files

if TYPE_CHECKING:
    from .verifier_toolchain import Toolchain

log = logging.getLogger(__name__)

SHIPPED_TASKS = Path(__file__).parent / "tasks"
REWARD_DIR = "/logs/verifier"
SOLUTION_DIR = "/solution"
REASON_TAIL_CHARS = 2000  # of the verifier's output, kept with a reward below 1

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": ("Run a bash command in the task's working directory and return its combined "
                        "stdout/stderr and exit code. Each call is a fresh shell: `cd` and variables do "
                        "not carry over, files do."),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to run."}},
            "required": ["command"],
        },
    },
}


# -- Harbor's folders at their real paths ----------------------------------------------------------

def _check(result: ExecResult, what: str) -> None:
    """A setup command of ours that fails means the sandbox is broken, not the agent."""
    if result.exit_code != 0:
        raise SandboxError(f"terminal-bench: {what} failed in the sandbox (exit {result.exit_code}): "
                           f"{(result.stderr or result.stdout).strip()[-300:]}")


class LocalSetupError(UserError):
    """A Dockerfile RUN step failed in the local sandbox: the task needs its container image (the
    message names the step and its output); run it with a container sandbox."""


def _folder_files(source: Path, target: str, task_root: Path) -> dict[str, bytes]:
    """A task folder (tests/ or solution/) as absolute path -> content, unmodified: the sandbox shows
    it at its real path (/tests, /solution)."""
    return {f"{target}/{rel}": path.read_bytes() for rel, path in staged_files(source, task_root)}


async def run_setup(task: HarborTask, sandbox: Sandbox) -> list[ExecResult]:
    """The Dockerfile's RUN steps that need only host tools, in order, each with the ENV, ARG and
    WORKDIR in effect at its line (the local sandbox: a container backend built them into the image)."""
    results = []
    made = [w for w in task.workdirs if w != task.workdir]
    if made:
        _check(await sandbox.exec("mkdir -p -- " + " ".join(shlex.quote(w) for w in made), timeout_s=30),
               "creating the Dockerfile's WORKDIRs")
    for step in task.setup:
        result = await sandbox.exec(step.command, cwd=step.workdir, env=step.env or None,
                                    timeout_s=max(task.agent_timeout_s, 600.0))
        results.append(result)
        if result.exit_code != 0:
            raise LocalSetupError(
                f"terminal-bench: task {task.name}: its Dockerfile's `{step.line[:80]}` failed in the local sandbox "
                f"(exit {result.exit_code}: {(result.stderr or result.stdout).strip()[-300:]}); it needs its "
                "container image: run it with a container sandbox (env.sandbox=docker or auto)")
    return results


# -- the episode ----------------------------------------------------------------------------------

def _format_output(result: ExecResult, max_chars: int) -> str:
    text = result.stdout + result.stderr
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    notes = []
    if result.timed_out:
        notes.append(f"[command timed out after {result.duration_s:.0f}s and was killed]")
    elif result.limit_hit:
        notes.append(f"[command stopped by the sandbox's {result.limit_hit} limit]")
    if result.output_truncated:
        notes.append("[output over the sandbox's limit was dropped]")
    notes.append(f"[exit code: {result.exit_code}]")
    return (text.rstrip("\n") + "\n" if text.strip() else "") + "\n".join(notes)


class TerminalBenchSession(EnvSession):
    """One episode: a `bash` tool over the sandbox, then the task's test.sh as verifier."""

    tools = [BASH_TOOL]

    def __init__(self, task: HarborTask, sandbox: Sandbox, command_timeout_s: float, max_output_chars: int,
                 toolchain: Toolchain | None = None, verifier_safe_path: bool = True,
                 played_by_oracle: Callable[[], bool] = lambda: False) -> None:
        self.task, self.sandbox = task, sandbox
        self.played_by_oracle = played_by_oracle  # the task's own solve.sh ran here: its services stay up
        self.command_timeout_s, self.max_output_chars = command_timeout_s, max_output_chars
        self.toolchain = toolchain  # the offline verifier toolchain, mounted for the verifier only
        self.verifier_safe_path = verifier_safe_path  # False: the verifier's Python keeps its cwd on sys.path
        self.agent_time_s = 0.0  # summed command time, held against the task's [agent] timeout_sec
        self.verifier_result: ExecResult | None = None  # kept for logs and debugging
        self.reward_reason: str | None = None  # why the reward is below 1 (exit code, reward file, output tail)
        self.setup_steps, self.setup_s = 0, 0.0  # the Dockerfile RUN steps run locally before the agent

    def result_details(self) -> dict[str, Any]:
        """For eval's per-task results: the verifier's exit code, output (tail and whole) and time, the
        local setup steps' time, and why the reward is below 1."""
        v = self.verifier_result
        out: dict[str, Any] = {"setup_steps": self.setup_steps, "setup_duration_s": round(self.setup_s, 3),
                               "agent_duration_s": round(self.agent_time_s, 3)}
        if self.reward_reason:
            out["reward_reason"] = self.reward_reason
        if v is not None:
            text = v.stdout + v.stderr
            out |= {"verifier_exit_code": v.exit_code, "verifier_duration_s": round(v.duration_s, 3),
                    "verifier_timed_out": v.timed_out, "verifier_tail": text[-REASON_TAIL_CHARS:],
                    "verifier_stdout": text}
        return out

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "bash":
            raise ToolError(f"unknown tool {name!r}; the only tool is bash")
        command = arguments.get("command") if isinstance(arguments, dict) else None
        if not isinstance(command, str) or not command.strip():
            raise ToolError('bash needs a non-empty string argument "command", e.g. {"command": "ls -la"}')
        left = self.task.agent_timeout_s - self.agent_time_s
        if left <= 0:
            return f"[the task's time limit of {self.task.agent_timeout_s:.0f}s is used up; command not run]"
        # stderr joins stdout inside the shell so the two interleave as the agent would see them.
        result = await self.sandbox.exec(f"exec 2>&1; {command}", timeout_s=min(self.command_timeout_s, left))
        self.agent_time_s += result.duration_s
        return _format_output(result, self.max_output_chars)

    def verifier_run(self, home: str | None = None) -> VerifierRun:
        """test.sh as Harbor runs it (``bash /tests/test.sh``), tests/ staged at /tests, with the offline
        toolchain (when configured) mounted for it and laid out as uv's installer would. ``home``: the
        HOME it runs with (the agent's, in a container: tests read ``~/.jupyter`` and the like), instead of
        the sandbox's fresh one."""
        files = _folder_files(self.task.path / "tests", "/tests", self.task.path)
        command, env, host_dirs = "bash /tests/test.sh", dict(self.task.verifier_env or {}), {}
        if self.toolchain is not None:
            command = f"{self.toolchain.setup_command()}; {command}"
            env = {**self.toolchain.env_vars(), **env}  # the task's own settings win
            host_dirs = self.toolchain.host_dirs()
        if not self.verifier_safe_path:  # tests that run `python -m pkg` from the workdir (the agent's code)
            env = {"PYTHONSAFEPATH": "", **env}
        if home:
            env = {"HOME": home, **env}
        return VerifierRun(command=command, files=files, output_dir=REWARD_DIR,
                           outputs=("reward.json", "reward.txt"), timeout_s=self.task.verifier_timeout_s,
                           env=env, host_dirs=host_dirs, end_agent_processes=not self.played_by_oracle())

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        """Run tests/test.sh on the final state (`Sandbox.run_verifier`) and read the reward file it wrote.
        A reward below 1 keeps its reason in `reward_reason` (and the exit code in the parts)."""
        verdict = await self.sandbox.run_verifier(self.verifier_run(await self._container_home()))
        self.verifier_result = result = verdict.result
        if verdict.setup_error is not None:
            self.reward_reason = f"the verifier could not be set up after the agent acted: {verdict.setup_error}"
            log.info("terminal-bench %s: %s; scored 0", self.task.name, self.reward_reason)
            return Reward(0.0, {"tests_passed": 0.0, "verifier_setup_failed": 1.0})
        if result is not None and result.timed_out:
            self.reward_reason = (f"test.sh timed out after {self.task.verifier_timeout_s:.0f}s "
                                  f"([verifier] timeout_sec){_output_tail(result)}")
            return Reward(0.0, {"tests_passed": 0.0, "verifier_timed_out": 1.0})
        reward, why = _reward_from(verdict.outputs)
        if reward.value < 1.0:
            if result is not None:
                reward = Reward(reward.value, {**reward.parts, "verifier_exit_code": float(result.exit_code)})
            code = f"test.sh exited {result.exit_code}; " if result is not None else ""
            self.reward_reason = f"{code}{why}{_output_tail(result)}"
            log.info("terminal-bench %s: reward %.3f: %s", self.task.name, reward.value, self.reward_reason)
        return reward


    async def _container_home(self) -> str | None:
        """The agent's HOME on a container backend, where Harbor's verifier shares it (the agent is root
        in its own image there: a fresh HOME would guard nothing); None on the local sandbox, whose
        verifier keeps its fresh home."""
        if getattr(self.sandbox, "name", "local") == "local":
            return None
        found = await self.sandbox.exec('printf %s "$HOME"', timeout_s=30)
        home = found.stdout.strip()
        return home if found.exit_code == 0 and home.startswith("/") else None


def _output_tail(result: ExecResult | None) -> str:
    if result is None:
        return ""
    text = (result.stdout + result.stderr).strip()
    return f"; its output ends: {text[-REASON_TAIL_CHARS:]}" if text else "; it printed nothing"


def _reward_from(outputs: dict[str, bytes]) -> tuple[Reward, str]:
    """The reward and what it was read from. reward.json wins over reward.txt, as in Harbor; a missing or
    garbled file is the agent's failure, scored 0."""
    for name, kind, cap in (("reward.json", "json", 65536), ("reward.txt", "txt", 4096)):
        if name in outputs:
            body = outputs[name][:cap].decode("utf-8", errors="replace")
            values = _parse_reward(kind, body)
            if values is None:
                return (Reward(0.0, {"tests_passed": 0.0, "reward_file_garbled": 1.0}),
                        f"{name} is not a reward ({body.strip()[:200]!r})")
            value, extra = values
            return Reward(value, {"tests_passed": value, **extra}), f"{name} says {body.strip()[:200]}"
    return (Reward(0.0, {"tests_passed": 0.0, "reward_file_missing": 1.0}),
            f"test.sh wrote neither reward.json nor reward.txt in {REWARD_DIR}")


def _parse_reward(kind: str, body: str) -> tuple[float, dict[str, float]] | None:
    """reward.txt: one number. reward.json: an object of numbers, Harbor's (multi-dimensional) rewards:
    the scalar is its "reward" key, else its only key; with several keys and no "reward" Harbor names no
    scalar (it aggregates each key apart), so the mean of the keys is the one trained on. The other keys
    are returned as parts. A non-numeric value garbles the file, as in Harbor."""
    def number(v: object) -> float | None:
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            return None
        try:
            x = float(v)
        except ValueError:
            return None
        return x if math.isfinite(x) else None

    if kind == "txt":
        x = number(body.strip())
        return None if x is None else (x, {})
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not data:
        return None
    nums = {str(k): number(v) for k, v in data.items() if not isinstance(v, str)}
    if len(nums) != len(data) or any(v is None for v in nums.values()):
        return None
    dims: dict[str, float] = {k: v for k, v in nums.items() if v is not None}
    if "reward" in dims:
        return dims.pop("reward"), dims
    if len(dims) == 1:
        return next(iter(dims.values())), {}
    return sum(dims.values()) / len(dims), {**dims, "reward_dimensions": float(len(dims))}


# -- the environment ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TerminalBenchOptions:
    """``env.options`` of terminal-bench (e.g. ``env.options.verifier_toolchain=none``)."""

    verifier_toolchain: str = "auto"  # a prepared folder, "auto" (the default one when prepared) or "none"
    # The verifier's Python without its cwd on sys.path (PYTHONSAFEPATH), so an agent's json.py cannot
    # pass the tests; false for tasks whose tests import the agent's package from the workdir, as Harbor allows.
    verifier_safe_path: bool = True
    command_timeout_s: float = 60.0  # one bash call's limit (the task's [agent] timeout bounds the sum)
    max_output_chars: int = 8000  # of a command's output shown to the agent (the middle is cut)
    # Which tasks without --tasks: "shipped" (the 24 hand-written ones) or "starter" (the generated family a
    # tiny model learns on, envs/terminal_bench/starter.py; the built-in warm start's, see warm_start_options).
    family: str = "shipped"


class TerminalBenchEnv(Environment):
    """Harbor-format terminal tasks (the shipped set or a --tasks folder), one bash tool, test.sh reward."""

    name: ClassVar[str] = "terminal-bench"
    description: ClassVar[str] = "Shell tasks in Harbor format: one bash tool in a sandbox, scored by the task's test.sh"
    needs_sandbox: ClassVar[bool] = True
    default_harness: ClassVar[str] = "terminal"  # the Terminus-style loop, which drives the bash tool
    env_keys: ClassVar[tuple[str, ...]] = ("sandbox", "sandbox_options")  # which backend runs the tasks
    options_type: ClassVar[type] = TerminalBenchOptions
    options_docs: ClassVar[str] = "docs/harbor.md"
    # The built-in warm start (model.warm_start=builtin) is made on the starter family, so a run that starts
    # from it plays that family unless env.options or --tasks say otherwise (miles_agent/build.py).
    warm_start_options: ClassVar[dict[str, Any]] = {"family": "starter"}
    # (steps, tool_rate): the kinds' commands are learnt in ~150 SFT steps (measured); a short lazy stage
    # (the demonstrator acts 30% of the time) leaves a policy that often claims to be done without acting.
    warm_start_stages: ClassVar[tuple[Any, ...]] = ((200, 1.0), (40, 0.3))

    def __init__(self, tasks_dir: str | Path | None = None, *, sandbox: str = "local",
                 sandbox_options: dict[str, Any] | None = None,
                 command_timeout_s: float = 60.0, max_output_chars: int = 8000,
                 verifier_toolchain: str | Path | None = "auto", verifier_safe_path: bool = True,
                 family: str = "shipped") -> None:
        """``sandbox`` names the configured backend: with "local", tasks that need their own image are
        left out of `tasks` (see `excluded`) because running them on the host would be wrong; with
        "auto", only when no container engine is reachable (``sandbox_options``: auto's options).
        ``verifier_toolchain``: the offline verifier toolchain (uv + a wheel cache) the verifier gets: a
        prepared folder, "auto" (the default folder when prepared) or "none"."""
        if tasks_dir and family != "shipped":
            raise UserError(f"terminal-bench: --tasks {tasks_dir} and env.options.family={family} both name the tasks; "
                            "keep one of them")
        self.family = family
        self.tasks_dir = Path(tasks_dir) if tasks_dir else _family_tasks(family)
        self.sandbox, self.sandbox_options = sandbox, dict(sandbox_options or {})
        self.toolchain = _toolchain_for(verifier_toolchain)
        self.verifier_safe_path = verifier_safe_path
        self.command_timeout_s, self.max_output_chars = command_timeout_s, max_output_chars
        self.harbor_tasks = {t.name: t for t in load_tasks(self.tasks_dir)}
        self._warned = False
        self._oracle_played: weakref.WeakSet[Sandbox] = weakref.WeakSet()  # sandboxes solve.sh ran in

    @property
    def excluded(self) -> dict[str, str]:
        """Tasks this configuration cannot run, with the reason (empty unless the sandbox is local)."""
        if self.sandbox == "auto":
            ok, why = self.container_engine()
            return {} if ok else {t.name: f"task {t.name} needs its container ({'; '.join(t.container_reasons)}), "
                                          f"but {why}" for t in self.harbor_tasks.values() if t.needs_container}
        if self.sandbox != "local":
            return {}
        return {t.name: _container_message(t) for t in self.harbor_tasks.values() if t.needs_container}

    def container_engine(self) -> tuple[bool, str]:
        """Whether the ``auto`` sandbox reaches a container engine, and where or why not."""
        from miles_agent import registry

        return registry.load("sandboxes", "auto").container_engine_of(self.sandbox_options)

    def routes(self) -> dict[str, tuple[str, str]]:
        """Where ``auto`` sends each task and why: (backend or "refused", reason)."""
        out = {}
        for t in self.harbor_tasks.values():
            if not t.needs_container:
                out[t.name] = ("local", "it needs only this host's tools" +
                               (f" ({len(t.setup)} Dockerfile RUN step(s) run locally)" if t.setup else ""))
            else:
                ok, why = self.container_engine()
                out[t.name] = ("docker" if ok else "refused", f"{'; '.join(t.container_reasons)}; {why}")
        return out

    def tasks(self, split: str = "train") -> list[Task]:
        chosen = [t for t in self.harbor_tasks.values()
                  if split == "all" or t.split is None or t.split == split]
        if not chosen:
            splits = sorted({t.split for t in self.harbor_tasks.values() if t.split})
            raise UserError(f"terminal-bench: no task in {self.tasks_dir} belongs to split {split!r}; "
                            f"its splits are: {', '.join(splits) or 'none declared (every split)'}, or 'all'")
        excluded = self.excluded
        if self.sandbox == "auto" and not self._warned:
            for name, (backend, why) in sorted(self.routes().items()):
                log.info("terminal-bench: task %s -> %s: %s", name, backend, why)
        if not self._warned:
            self._warned = True
            if excluded:
                log.warning("terminal-bench: %d task(s) need their own container image and are left out with the "
                            "%s sandbox: %s", len(excluded), self.sandbox, "; ".join(excluded.values()))
        runnable = [t for t in chosen if t.name not in excluded]
        if not runnable:
            raise UserError(f"terminal-bench: all {len(chosen)} task(s) of split {split!r} in {self.tasks_dir} "
                            "need their own container image; configure a container sandbox (e.g. docker)")
        return [self._as_task(t) for t in runnable]

    @staticmethod
    def _as_task(t: HarborTask) -> Task:
        info = {"difficulty": t.difficulty, "category": t.category, "tags": list(t.tags), "path": str(t.path),
                "agent_timeout_s": t.agent_timeout_s, "verifier_timeout_s": t.verifier_timeout_s,
                "needs_container": t.needs_container, "container_reasons": list(t.container_reasons)}
        return Task(id=t.name, messages=({"role": "user", "content": t.instruction},), info=info)

    def harbor_task(self, task: Task | str) -> HarborTask:
        name = task if isinstance(task, str) else task.id
        if name not in self.harbor_tasks:
            raise UserError(f"terminal-bench: unknown task {name!r} (not in {self.tasks_dir})")
        return self.harbor_tasks[name]

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """On a container backend a task with its own image runs as Harbor runs it: ``docker_image``, or
        environment/ built with its Dockerfile (files, ENV and WORKDIR come from the image; [environment]
        workdir overrides it), with the task's network request, CPUs and memory."""
        t = self.harbor_task(task)
        longest = max(t.agent_timeout_s, t.verifier_timeout_s)  # the default; each exec passes its own
        limits = SandboxLimits(wall_time_s=longest, cpu_time_s=math.ceil(longest),
                               **({"memory_bytes": t.memory_mb << 20} if t.memory_mb else {}))
        dockerfile = t.path / "environment" / "Dockerfile"
        # auto runs on local what runs there faithfully, so only a task that needs its image gets one.
        wants_image = t.needs_container if self.sandbox == "auto" else self.sandbox != "local"
        if wants_image and (t.docker_image or dockerfile.is_file()):
            build = None if t.docker_image else ImageBuild(context=str(dockerfile.parent))
            return SandboxSpec(image=t.docker_image, build=build, env=dict(t.environment_env), limits=limits,
                               workdir=t.workdir_override, network=t.network, cpus=t.cpus)
        if t.needs_container and wants_image:
            raise UserError(f"terminal-bench: task {t.name} needs its own image ({'; '.join(t.container_reasons)}) "
                            f"but has neither [environment] docker_image nor {dockerfile}; add one of them")
        files = {rel: src.read_bytes() for rel, src in t.files.items()}
        return SandboxSpec(files=files, env=dict(t.env), limits=limits, workdir=t.workdir,
                           network=t.network, cpus=t.cpus)

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        t = self.harbor_task(task)
        if sandbox is None:
            raise UserError("terminal-bench needs a sandbox; start one from sandbox_spec(task) and pass it to open")
        backend = (getattr(sandbox, "route", None) or {}).get("backend") or getattr(sandbox, "name", "")
        if t.needs_container and backend == "local":
            raise UserError(f"terminal-bench: {_container_message(t)}")
        # Staged files exist only where the spec carried them: a sandbox built from the task's image has its own.
        from_image = backend != "local" and bool(t.docker_image or (t.path / "environment" / "Dockerfile").is_file())
        executable = [] if from_image else [rel for rel, src in t.files.items() if src.stat().st_mode & 0o111]
        if executable:
            _check(await sandbox.exec("chmod +x -- " + " ".join(shlex.quote(p) for p in executable),
                                      timeout_s=30), "marking environment scripts executable")
        session = TerminalBenchSession(t, sandbox, self.command_timeout_s, self.max_output_chars,
                                       toolchain=self.toolchain, verifier_safe_path=self.verifier_safe_path,
                                       played_by_oracle=lambda: sandbox in self._oracle_played)
        if backend == "local":  # a container backend built the RUN steps into its image
            try:
                steps = await run_setup(t, sandbox)
            except LocalSetupError as e:
                if self.sandbox != "auto" or not self.container_engine()[0]:
                    raise
                # auto: from now on the task needs its container; the episode is retried there.
                self.harbor_tasks[t.name] = dataclasses.replace(t, container_reasons=(str(e),))
                raise SandboxError(f"terminal-bench: task {t.name} goes to a container: {e}") from None
            session.setup_steps, session.setup_s = len(steps), sum(r.duration_s for r in steps)
        return session

    def demonstrator(self, tokenizer: Any, tool_rate: float = 1.0, seed: int = 0):  # noqa: ANN201
        """The scripted player of the starter family: the built-in warm start's SFT data (miles_agent/warmstart.py)."""
        from .starter import StarterDemonstrator

        return StarterDemonstrator(tokenizer, tool_rate=tool_rate, seed=seed)

    async def oracle_solve(self, task: Task | str, sandbox: Sandbox) -> ExecResult:
        """Run the task's solution/solve.sh in the sandbox (the oracle policy); the caller scores after."""
        t = self.harbor_task(task)
        if not t.has_solution:
            raise UserError(f"terminal-bench: task {t.name} has no oracle; add {t.path / 'solution' / 'solve.sh'}")
        _check(await sandbox.exec(f"rm -rf {SOLUTION_DIR} && mkdir -p {SOLUTION_DIR}", timeout_s=30),
               f"preparing {SOLUTION_DIR}")
        for path, data in _folder_files(t.path / "solution", SOLUTION_DIR, t.path).items():
            await sandbox.write_file(path, data)
        self._oracle_played.add(sandbox)  # the task author's commands: what they start stays up for the tests
        return await sandbox.exec(f"bash {SOLUTION_DIR}/solve.sh", timeout_s=t.agent_timeout_s,
                                  env=t.solution_env or None)


def _family_tasks(family: str) -> Path:
    if family == "shipped":
        return SHIPPED_TASKS
    if family == "starter":
        from .starter import family_dir

        return family_dir()
    raise UserError(f"terminal-bench: env.options.family={family!r} is not a task family; use shipped (the "
                    "hand-written tasks) or starter (the generated one-command family), or pass --tasks DIR")


def _toolchain_for(setting: str | Path | None) -> Toolchain | None:
    # Imported here: `python -m ...verifier_toolchain` must not find the module loaded by the package.
    from .verifier_toolchain import resolve

    return resolve(setting)


def _container_message(t: HarborTask) -> str:
    return (f"task {t.name} needs its own container image ({'; '.join(t.container_reasons)}), which the local "
            "sandbox cannot provide; run it with a container sandbox (e.g. docker) or leave it out")
