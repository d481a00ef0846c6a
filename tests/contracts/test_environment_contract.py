"""The environment contract against the shipped environments (arith-tools; terminal-bench in the local
sandbox), and against environments broken on purpose."""

from __future__ import annotations

import shutil

import pytest

from miles_agent.environment import Environment, EnvSession, Reward, Task
from miles_agent.envs.arith_tools.env import ArithToolsEnv
from miles_agent.envs.terminal_bench import TerminalBenchEnv
from miles_agent.testing.contracts import EnvironmentContract


class TestArithTools(EnvironmentContract):
    @pytest.fixture
    def environment(self):
        return ArithToolsEnv()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
class TestTerminalBench(EnvironmentContract):
    @pytest.fixture
    def environment(self):
        return TerminalBenchEnv()

    @pytest.fixture
    def make_sandbox(self):
        from miles_agent.sandboxes.local import LocalSandbox

        return LocalSandbox


class Generous(EnvSession):
    async def score(self, messages):
        return Reward(5.0)


class OverScoring(Environment):
    name, description = "over-scoring", "rewards outside 0..1"

    def tasks(self, split="train"):
        return [Task(id="a", messages=({"role": "user", "content": "hi"},))] * 2

    async def open(self, task, sandbox=None):
        return Generous()


def test_broken_environments_fail_the_contract():
    contract = EnvironmentContract()
    with pytest.raises(AssertionError, match="outside"):
        contract.test_open_and_score_return_a_reward_in_range(OverScoring(), None)
    with pytest.raises(AssertionError, match="not unique"):
        contract.test_tasks_are_listed(OverScoring())
