"""swe: SWE-bench-style coding tasks -- a repository at a base commit, an issue, hidden tests.

An episode: the repository is checked out at ``base_commit`` in the sandbox's /testbed (only its history,
from a git bundle), the instance's setup commands run, and the agent works there through one ``bash``
tool (the `aci` harness builds its file viewer, search, edits and test runs on it; the black-box harness
gives it to an external agent). The model's final patch is ``git diff`` of the work against the base.
Scoring never trusts the agent's sandbox beyond that diff: a fresh sandbox of the same backend gets the
repository, the patch and the test patch, and runs FAIL_TO_PASS and PASS_TO_PASS (`grading`).

Instances come from a SWE-bench-format JSONL (`instance`) with local repositories, or -- by default --
the instances the project ships (`shipped`), built into git repositories once and cached.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, ClassVar

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.errors import UserError
from miles_agent.sandbox import ExecResult, Sandbox, SandboxError, SandboxSpec

from . import grading
from .instance import Instance, Repositories, load_instances

log = logging.getLogger(__name__)

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": ("Run a bash command in the repository (/testbed) and return its combined output and "
                        "exit code. Each call is a fresh shell: `cd` does not carry over, files do."),
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
INSTRUCTIONS = ("The repository is checked out in /testbed, your working directory. Fix the issue below by "
                "changing the code; the tests that check the fix are hidden, and your changes to test files "
                "are not kept.\n\n<issue>\n{issue}\n</issue>")


def format_output(result: ExecResult, max_chars: int) -> str:
    text = result.stdout + result.stderr
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    note = (f"[timed out after {result.duration_s:.0f}s]" if result.timed_out
            else f"[stopped by the sandbox's {result.limit_hit} limit]" if result.limit_hit else "")
    return (text.rstrip("\n") + "\n" if text.strip() else "") + (note + "\n" if note else "") + \
        f"[exit code: {result.exit_code}]"


class SWESession(EnvSession):
    tools = [BASH_TOOL]

    def __init__(self, env: SWEEnv, instance: Instance, sandbox: Sandbox) -> None:
        self.env, self.instance, self.sandbox = env, instance, sandbox
        self.patch: str | None = None  # the agent's final diff, once scored
        self.verdict: grading.Verdict | None = None

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "bash":
            raise ToolError(f"unknown tool {name!r}; the only tool is bash")
        command = arguments.get("command") if isinstance(arguments, dict) else None
        if not isinstance(command, str) or not command.strip():
            raise ToolError('bash needs a non-empty string argument "command", e.g. {"command": "ls"}')
        result = await self.sandbox.exec(f"exec 2>&1; {command}", timeout_s=self.env.command_timeout_s)
        return format_output(result, self.env.max_output_chars)

    async def final_patch(self) -> str:
        """``git diff`` of everything the agent changed since the base commit ("" when it broke the repository)."""
        result = await self.sandbox.exec(grading.diff_command(self.instance.base_commit), timeout_s=120)
        if result.exit_code != 0:
            log.info("swe %s: no diff (exit %d): %s", self.instance.instance_id, result.exit_code,
                     (result.stderr or result.stdout)[-300:])
            return ""
        return result.stdout

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        self.patch = await self.final_patch()
        self.verdict = await self.env.score_patch(self.instance, self.patch)
        return self.verdict.reward

    def result_details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"patch": self.patch or ""}
        return out | (self.verdict.details() if self.verdict else {})


@dataclasses.dataclass(frozen=True)
class SWEOptions:
    """``env.options`` of swe (e.g. ``env.options.instances=data/swe.jsonl env.options.repos=data/repos``)."""

    instances: str = ""  # a SWE-bench-format JSONL; "" = the shipped instances
    repos: str = ""  # the folder of git repositories (owner__name/ or owner__name.bundle); default: next to it
    command_timeout_s: float = 120.0  # one bash call's limit
    max_output_chars: int = 8000  # of a command's output shown to the agent (the middle is cut)


class SWEEnv(Environment):
    name: ClassVar[str] = "swe"
    description: ClassVar[str] = ("Coding tasks in SWE-bench's format: fix a repository's issue; scored by its hidden "
                                  "tests in a fresh sandbox")
    needs_sandbox: ClassVar[bool] = True
    default_harness: ClassVar[str] = "aci"
    env_keys: ClassVar[tuple[str, ...]] = ("sandbox", "sandbox_options")
    options_type: ClassVar[type] = SWEOptions
    options_docs: ClassVar[str] = "docs/coding.md"

    def __init__(self, tasks_dir: str | Path | None = None, *, instances: str | Path = "", repos: str | Path = "",
                 sandbox: str = "local", sandbox_options: dict[str, Any] | None = None,
                 command_timeout_s: float = 120.0, max_output_chars: int = 8000, make_sandbox: Any = None) -> None:
        """``tasks_dir`` (``--tasks``): a folder with instances.jsonl and repos/. ``make_sandbox``: a
        zero-argument factory of fresh sandboxes for scoring (default: the configured backend with its
        options, as the episodes get)."""
        if tasks_dir and not instances:
            instances = Path(tasks_dir) / "instances.jsonl"
        if instances:
            path = Path(instances)
            self.instances = {i.instance_id: i for i in load_instances(path)}
            repos_dir = Path(repos) if repos else path.parent / "repos"
        else:
            from .shipped import build_shipped

            path, repos_dir = build_shipped()
            self.instances = {i.instance_id: i for i in load_instances(path)}
        self.repos = Repositories(repos_dir)
        self.sandbox, self.sandbox_options = sandbox, dict(sandbox_options or {})
        self.command_timeout_s, self.max_output_chars = command_timeout_s, max_output_chars
        self._make_sandbox = make_sandbox

    @property
    def excluded(self) -> dict[str, str]:
        """Instances this configuration cannot run: with the local sandbox, those that name an image."""
        if self.sandbox != "local":
            return {}
        return {i.instance_id: f"instance {i.instance_id} needs its image {i.image}, which the local sandbox cannot "
                               "provide; run it with env.sandbox=docker" for i in self.instances.values() if i.image}

    def tasks(self, split: str = "train") -> list[Task]:
        chosen = [i for i in self.instances.values() if split == "all" or i.split in (None, split)]
        runnable = [i for i in chosen if i.instance_id not in self.excluded]
        if not runnable:
            raise UserError(f"swe: no instance of split {split!r} runs with the {self.sandbox} sandbox"
                            + (f" ({len(chosen)} need their image: use env.sandbox=docker)" if chosen else ""))
        return [Task(id=i.instance_id, messages=({"role": "user", "content": INSTRUCTIONS.format(
            issue=i.problem_statement.strip())},), info={"repo": i.repo, "base_commit": i.base_commit})
            for i in runnable]

    def instance(self, task: Task | str) -> Instance:
        name = task if isinstance(task, str) else task.id
        if name not in self.instances:
            raise UserError(f"swe: unknown instance {name!r}")
        return self.instances[name]

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        inst = self.instance(task)
        return grading.sandbox_spec(inst, self.repos.bundle(inst.repo, inst.base_commit),
                                    with_image=self.sandbox != "local")

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        if sandbox is None:
            raise UserError("swe needs a sandbox; start one from sandbox_spec(task) and pass it to open")
        inst = self.instance(task)
        done = await sandbox.exec(grading.checkout_script(inst), timeout_s=inst.test_timeout_s + 120)
        if done.exit_code != 0:
            raise SandboxError(f"swe: {inst.instance_id}: checking out {inst.base_commit[:12]} or its setup failed "
                               f"(exit {done.exit_code}): {(done.stderr or done.stdout).strip()[-300:]}")
        return SWESession(self, inst, sandbox)

    def fresh_sandbox(self) -> Sandbox:
        if self._make_sandbox is None:
            from miles_agent.build import sandbox_factory

            self._make_sandbox = sandbox_factory(self.sandbox, self.sandbox_options)
        return self._make_sandbox()

    async def score_patch(self, instance: Instance | str, patch: str) -> grading.Verdict:
        """Grade ``patch`` on ``instance`` in a fresh sandbox (the reward and why)."""
        inst = instance if isinstance(instance, Instance) else self.instance(instance)
        verdict = await grading.score_patch(inst, patch, self.repos.bundle(inst.repo, inst.base_commit),
                                            self.fresh_sandbox(), with_image=self.sandbox != "local")
        if verdict.reward.value < 1.0:
            log.info("swe %s: reward %.1f: %s", inst.instance_id, verdict.reward.value, verdict.reason)
        return verdict

    async def oracle_solve(self, task: Task | str, sandbox: Sandbox) -> ExecResult:
        """Apply the gold patch in the agent's sandbox (the oracle policy); the caller scores after."""
        inst = self.instance(task)
        if not inst.patch.strip():
            raise UserError(f"swe: instance {inst.instance_id} has no gold patch (the `patch` field)")
        await sandbox.write_file(f"{grading.HOME}/gold.patch", inst.patch.encode())
        return await sandbox.exec(f"git apply --whitespace=nowarn {grading.HOME}/gold.patch", timeout_s=60)
