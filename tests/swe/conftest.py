"""Shared pieces of the swe tests: the shipped env on the local sandbox and an episode runner."""

from __future__ import annotations

import json

import pytest

from miles_agent.sandboxes.local import LocalSandbox


@pytest.fixture(scope="session")
def swe_env():
    from miles_agent.envs.swe import SWEEnv

    return SWEEnv(sandbox="local")


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def play(env, task, harness, policy):
    """One episode as the episode runner plays it: sandbox from the spec, open, harness, close, stop."""
    async with LocalSandbox() as sandbox:
        await sandbox.start(env.sandbox_spec(task))
        session = await env.open(task, sandbox)
        try:
            return await harness.run(task, session, policy), session
        finally:
            await session.close()
