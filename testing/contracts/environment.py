"""The environment contract (``miles_agent.environment.Environment``): tasks are listed, and an episode
opened on a task scores to a ``Reward`` in range, with the sandbox the environment asked for.

Provide ``environment`` (an instance). When it ``needs_sandbox``, also ``make_sandbox`` (a callable returning
an unstarted sandbox). Optional: ``reward_range`` (default 0..1), ``split`` (default "train").
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.sandbox import Sandbox
from miles_agent.testing.contracts._fixtures import fixture_missing

ANSWER = {"role": "assistant", "content": "I do not know."}


async def with_session(env: Environment, task: Task, make_sandbox: Callable[[], Sandbox] | None,
                       use: Callable[[EnvSession], Any]) -> Any:
    """Open ``task`` (in a started sandbox when the environment needs one), ``use`` the session, and
    close the session, then the sandbox -- the episode runner's order."""
    sandbox = None
    if env.needs_sandbox:
        assert make_sandbox is not None, f"{env.name} needs a sandbox: provide the make_sandbox fixture"
        sandbox = make_sandbox()
        await sandbox.start(env.sandbox_spec(task))
    try:
        session = await env.open(task, sandbox)
        try:
            return await use(session)
        finally:
            await session.close()
    finally:
        if sandbox is not None:
            await sandbox.stop()


class EnvironmentContract:
    reward_range = (0.0, 1.0)
    split = "train"

    @pytest.fixture
    def environment(self) -> Environment:
        fixture_missing("EnvironmentContract", "environment", "an Environment instance")

    @pytest.fixture
    def make_sandbox(self) -> Callable[[], Sandbox] | None:
        return None

    def test_tasks_are_listed(self, environment) -> None:
        assert environment.name and environment.description, "a plug-in has a name and a description"
        tasks = environment.tasks(self.split)
        assert tasks, f"no task in split {self.split!r}"
        assert all(isinstance(t, Task) for t in tasks), "tasks() returns Task objects"
        ids = [t.id for t in tasks]
        assert len(set(ids)) == len(ids), "task ids are not unique"
        for t in tasks:
            assert t.messages and all("role" in m and "content" in m for m in t.messages), \
                f"task {t.id}: messages need a role and a content each"

    def test_open_and_score_return_a_reward_in_range(self, environment, make_sandbox) -> None:
        task = environment.tasks(self.split)[0]

        async def use(session: EnvSession) -> Reward:
            return await session.score([*task.messages, ANSWER])

        reward = asyncio.run(with_session(environment, task, make_sandbox, use))
        assert isinstance(reward, Reward), f"score returned {type(reward).__name__}, not a Reward"
        low, high = self.reward_range
        assert math.isfinite(reward.value) and low <= reward.value <= high, \
            f"reward {reward.value} outside {self.reward_range}"
        assert all(math.isfinite(float(v)) for v in reward.parts.values()), f"non-finite parts {reward.parts}"

    def test_tools_are_function_schemas_and_a_bad_call_is_a_tool_error(self, environment, make_sandbox) -> None:
        task = environment.tasks(self.split)[0]

        async def use(session: EnvSession) -> list[dict[str, Any]]:
            with pytest.raises(ToolError):
                await session.call_tool("no-such-tool-contract", {})
            return list(session.tools)

        tools = asyncio.run(with_session(environment, task, make_sandbox, use))
        for tool in tools:
            assert tool.get("type") == "function" and tool.get("function", {}).get("name"), \
                f"not an OpenAI function schema: {tool}"
