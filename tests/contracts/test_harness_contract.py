"""The harness contract against the shipped harnesses (chat-tools, terminal, black-box with the shipped
OpenAI tool-loop agent as a function), and against harnesses broken on purpose."""

from __future__ import annotations

import pytest

from miles_agent.harnesses.chat_tools import ChatToolsHarness
from miles_agent.harnesses.terminal import TerminalHarness
from miles_agent.testing.contracts import HarnessContract
from miles_agent.testing.contracts.harness import run_episode


class TestChatTools(HarnessContract):
    @pytest.fixture
    def harness_class(self):
        return ChatToolsHarness


class TestTerminal(HarnessContract):
    @pytest.fixture
    def harness_class(self):
        return TerminalHarness


class TestBlackBox(HarnessContract):
    @pytest.fixture
    def harness_class(self):
        pytest.importorskip("aiohttp", reason="the proxy extra is not installed")
        pytest.importorskip("openai", reason="the proxy extra is not installed")
        from miles_agent.harnesses.blackbox import BlackBoxHarness

        return BlackBoxHarness

    @pytest.fixture
    def harness_kwargs(self):
        return {"agent": "miles_agent.harnesses.agents.openai_tool_loop:agent", "agent_timeout_s": 120.0}


class DropsTheLastToken(ChatToolsHarness):
    """Masks out the last sampled token (an off-by-one at the end of a turn)."""

    async def run(self, task, session, policy):
        trajs = await super().run(task, session, policy)
        for t in trajs:
            t.loss_mask = t.loss_mask[:-1] + [0]
        return trajs


class NeverScores(ChatToolsHarness):
    async def run(self, task, session, policy):
        trajs = await super().run(task, session, policy)
        for t in trajs:
            t.reward = 0.0
        return trajs


def test_broken_harnesses_fail_the_contract():
    contract = HarnessContract()
    episode = run_episode(NeverScores, {}, contract.limits)
    with pytest.raises(AssertionError, match="the verifier said"):
        contract.test_trajectories_carry_the_verifiers_reward(episode)
    episode = run_episode(DropsTheLastToken, {}, contract.limits)
    with pytest.raises(AssertionError, match="not the sampled tokens"):
        contract.test_learns_exactly_what_the_policy_sampled(episode)
