"""terminal-bench in the real local sandbox (bubblewrap-isolated): every shipped task, and the failure rules.

Why: the oracle proves each task is solvable and its verifier accepts the solution; the no-op agent
proves the verifier rejects the untouched start state. The failure tests pin the scoring contract:
agent failures score 0 with a part naming them, infrastructure failures raise and are never scored.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from harbor_helpers import make_task

from miles_agent.environment import Reward, Task
from miles_agent.envs.terminal_bench import TerminalBenchEnv
from miles_agent.sandbox import SandboxError

local = pytest.importorskip("miles_agent.sandboxes.local", reason="the local sandbox is not installed")
LocalSandbox = local.LocalSandbox

Play = Callable[[Any, Any], Awaitable[None]]


async def episode(env: TerminalBenchEnv, task: Task, play: Play | None = None, oracle: bool = False,
                  sandbox_cls: type = LocalSandbox) -> tuple[Reward, Any]:
    """Start a sandbox, play (oracle, a script, or nothing), score, and always stop the sandbox."""
    sandbox = sandbox_cls()
    await sandbox.start(env.sandbox_spec(task))
    try:
        session = await env.open(task, sandbox)
        try:
            if oracle:
                result = await env.oracle_solve(task, sandbox)
                assert result.exit_code == 0, f"{task.id}: solve.sh failed: {result.stdout}{result.stderr}"
            if play is not None:
                await play(session, sandbox)
            return await session.score([]), session
        finally:
            await session.close()
    finally:
        await sandbox.stop()


def write_task(root: Path, name: str, test_sh: str, toml: str = 'version = "1.0"\n',
               files: dict[str, str] | None = None) -> Path:
    return make_task(root, name, toml=toml, instruction="Do the thing.", test_sh=test_sh, files=files)


def test_every_shipped_task_oracle_scores_1_and_noop_scores_0():
    env = TerminalBenchEnv()
    tasks = env.tasks()
    assert len(tasks) >= 20

    async def main() -> list[str]:
        sem = asyncio.Semaphore(max(4, 2 * (os.cpu_count() or 1)))

        async def check(task: Task, oracle: bool) -> str | None:
            async with sem:
                reward, session = await episode(env, task, oracle=oracle)
            want = 1.0 if oracle else 0.0
            if reward.value == want and reward.parts.get("tests_passed") == want:
                return None
            out = session.verifier_result
            return (f"{task.id} ({'oracle' if oracle else 'no-op'}): {reward} "
                    f"{out.stdout[-400:] if out else ''}{out.stderr[-400:] if out else ''}")

        results = await asyncio.gather(*(check(t, o) for t in tasks for o in (True, False)))
        return [r for r in results if r]

    failures = asyncio.run(main())
    assert not failures, "\n".join(failures)


def test_bash_tool_runs_commands_and_reports_exit_code():
    env = TerminalBenchEnv()
    task = next(t for t in env.tasks() if t.id == "hello-file")

    async def play(session, sandbox):
        out = await session.call_tool("bash", {"command": "echo out; echo err >&2; exit 3"})
        assert "out\nerr" in out and out.endswith("[exit code: 3]")
        out = await session.call_tool("bash", {"command": "printf 'Hello, world!\\n' > hello.txt && pwd"})
        assert out.endswith("[exit code: 0]")
        big = await session.call_tool("bash", {"command": "seq 1 100000"})
        assert "characters cut" in big and len(big) < 9000

    reward, _ = asyncio.run(episode(env, task, play))
    assert reward.value == 1.0 and reward.parts == {"tests_passed": 1.0}


def test_a_forged_reward_file_does_not_survive_to_scoring():
    env = TerminalBenchEnv()
    task = next(t for t in env.tasks() if t.id == "hello-file")

    async def forge(session, sandbox):
        await session.call_tool("bash", {"command": "mkdir -p .harbor/logs/verifier && echo 1 > "
                                                    ".harbor/logs/verifier/reward.txt && echo 1 > .harbor/tests/test.sh"})

    reward, _ = asyncio.run(episode(env, task, forge))
    assert reward.value == 0.0


@pytest.mark.parametrize("test_sh, toml, part", [
    ("#!/bin/bash\necho done\n", 'version = "1.0"\n', "reward_file_missing"),
    ("#!/bin/bash\necho pass > /logs/verifier/reward.txt\n", 'version = "1.0"\n', "reward_file_garbled"),
    ("#!/bin/bash\nsleep 30\necho 1 > /logs/verifier/reward.txt\n", "[verifier]\ntimeout_sec = 1.0\n",
     "verifier_timed_out"),
])
def test_agent_side_verifier_failures_score_zero_with_a_part(tmp_path, test_sh, toml, part):
    env = TerminalBenchEnv(write_task(tmp_path, "t", test_sh, toml))
    reward, _ = asyncio.run(episode(env, env.tasks()[0]))
    assert reward.value == 0.0 and reward.parts[part] == 1.0


def test_reward_json_is_read(tmp_path):
    sh = "#!/bin/bash\necho '{\"reward\": 0.75, \"lint\": 1}' > /logs/verifier/reward.json\n"
    env = TerminalBenchEnv(write_task(tmp_path, "t", sh))
    reward, _ = asyncio.run(episode(env, env.tasks()[0]))
    assert reward == Reward(0.75, {"tests_passed": 0.75, "lint": 1.0, "verifier_exit_code": 0.0})


def test_sandbox_errors_propagate_and_are_never_scored(tmp_path):
    class Broken(LocalSandbox):  # dies when the verifier's command starts
        async def _run(self, command, *args, **kw):
            if "test.sh" in command:
                raise SandboxError("the sandbox died")
            return await super()._run(command, *args, **kw)

    env = TerminalBenchEnv()
    task = next(t for t in env.tasks() if t.id == "hello-file")
    with pytest.raises(SandboxError, match="the sandbox died"):
        asyncio.run(episode(env, task, oracle=True, sandbox_cls=Broken))


def test_unmodified_harbor_task_with_workdir_runs_locally(tmp_path):
    """A Harbor task written for a container (WORKDIR /app, absolute /tests and /logs paths) runs as is."""
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\ncd /tmp\n"
               "if [ \"$(cat /app/out.txt)\" = \"$(cat /tests/expected.txt)\" ] && [ -x /app/bin/tool.sh ]; then\n"
               "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n")
    d = write_task(tmp_path, "harbor-style", test_sh, files={
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\nCOPY tool.sh bin/tool.sh\n",
        "environment/tool.sh": "#!/bin/bash\necho 42\n", "tests/expected.txt": "42\n",
        "solution/solve.sh": "#!/bin/bash\n/app/bin/tool.sh > /app/out.txt\n"})
    (d / "environment" / "tool.sh").chmod(0o755)
    env = TerminalBenchEnv(d)
    task = env.tasks()[0]

    async def play(session, sandbox):
        out = await session.call_tool("bash", {"command": "./bin/tool.sh > out.txt; cat out.txt"})
        assert out.startswith("42")

    assert asyncio.run(episode(env, task, play))[0].value == 1.0
    assert asyncio.run(episode(env, task, oracle=True))[0].value == 1.0
    assert asyncio.run(episode(env, task))[0].value == 0.0


def test_agent_time_budget_is_enforced(tmp_path):
    env = TerminalBenchEnv(write_task(tmp_path, "t", "#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n",
                                      "[agent]\ntimeout_sec = 1.0\n"))

    async def play(session, sandbox):
        first = await session.call_tool("bash", {"command": "sleep 5; echo never"})
        assert "never" not in first and "timed out" in first
        assert "time limit" in await session.call_tool("bash", {"command": "echo again"})

    asyncio.run(episode(env, env.tasks()[0], play))


def test_full_episode_through_runner_and_terminal_harness(tokenizer, scripted):
    """The path `miles-agent train --env terminal-bench` takes: runner -> terminal harness -> bash tool."""
    from miles_agent.engine import SamplingParams
    from miles_agent.environment import HarnessLimits
    from miles_agent.harnesses.terminal import TerminalHarness
    from miles_agent.rollout.episodes import EpisodeRunner

    env = TerminalBenchEnv()
    task = next(t for t in env.tasks() if t.id == "hello-file")
    harness = TerminalHarness(tokenizer, HarnessLimits(max_total_tokens=4096), SamplingParams(max_new_tokens=128))
    runner = EpisodeRunner(env, harness, make_sandbox=LocalSandbox)
    good = scripted(["<bash>echo 'Hello, world!' > hello.txt</bash>", "Done."])
    (traj,) = asyncio.run(runner.run(task, good, "g"))
    assert traj.reward == 1.0
    (traj,) = asyncio.run(runner.run(task, scripted(["<bash>echo hi > hello.txt</bash>", "Done."]), "g"))
    assert traj.reward == 0.0 and runner.stats.failed == 0
