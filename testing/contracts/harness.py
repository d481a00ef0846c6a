"""The harness contract (``miles_agent.environment.Harness``): an episode returns trajectories that pass
``validate()``, learn exactly from what the policy sampled, and carry the verifier's reward.

Provide ``harness_class``: a callable ``(tokenizer, limits, sampling, **harness_kwargs)`` (a harness
plug-in class). Optional: ``harness_kwargs``. The policy is the embedded engine on a tiny model, so its
output is arbitrary text: a harness must turn any model output into a valid trajectory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from miles_agent.engine import Completion, SamplingParams
from miles_agent.environment import EnvSession, Harness, HarnessLimits, Reward, Task, ToolError
from miles_agent.testing.contracts._fixtures import fixture_missing
from miles_agent.types import Status, Trajectory

TASK = Task(id="contract-0", messages=({"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": "What is 2 + 3?"}))
ECHO = {"type": "function", "function": {"name": "echo", "description": "echo the text back",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


class ContractSession(EnvSession):
    """One echo tool; the reward is a constant the test can recognise."""

    tools = [ECHO]
    reward = 0.25

    def __init__(self) -> None:
        self.scored = 0

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "echo":
            raise ToolError(f"unknown tool {name!r}")
        return str(arguments.get("x", ""))

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        self.scored += 1
        return Reward(self.reward, {"constant": self.reward})


class RecordingPolicy:
    """The embedded engine, remembering every completion it returned."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.completions = engine, []

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        out = await self.engine.generate(input_ids, sampling, return_routed_experts=return_routed_experts)
        self.completions.append(out)
        return out


def run_episode(harness_class: Callable[..., Harness], kwargs: dict[str, Any], limits: HarnessLimits
                ) -> tuple[list[Trajectory], RecordingPolicy, ContractSession]:
    """One episode of ``TASK`` with the embedded engine on tiny-qwen3 as the policy."""
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    model, tok = build_tiny("tiny-qwen3", seed=0)
    policy, session = RecordingPolicy(EmbeddedEngine(model, tok)), ContractSession()
    sampling = SamplingParams(max_new_tokens=limits.max_new_tokens_per_turn, seed=5)
    harness = harness_class(tok, limits, sampling, **kwargs)
    return asyncio.run(harness.run(TASK, session, policy)), policy, session


class HarnessContract:
    limits = HarnessLimits(max_turns=3, max_total_tokens=768, max_new_tokens_per_turn=24)

    @pytest.fixture
    def harness_class(self) -> Callable[..., Harness]:
        fixture_missing("HarnessContract", "harness_class", "the Harness class")

    @pytest.fixture
    def harness_kwargs(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def episode(self, harness_class, harness_kwargs) -> tuple[list[Trajectory], RecordingPolicy, ContractSession]:
        return run_episode(harness_class, harness_kwargs, self.limits)

    def test_returns_trajectories_that_validate(self, episode) -> None:
        trajs, policy, _ = episode
        assert trajs and all(isinstance(t, Trajectory) for t in trajs), "run returns a non-empty list of Trajectory"
        for t in trajs:
            t.validate()
            assert t.status in tuple(Status), t.status
            assert t.task_id == TASK.id, f"task_id {t.task_id!r} is not the task's"
        assert policy.completions, "the harness never called the policy"

    def test_learns_exactly_what_the_policy_sampled(self, episode) -> None:
        """Every sampled token trains, once, in order (no limit binds within ``limits``)."""
        trajs, policy, _ = episode
        sampled = [i for t in trajs for i, m in zip(t.response_ids, t.loss_mask) if m]
        logps = [lp for t in trajs for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m]
        returned = [i for c in policy.completions for i in c.output_ids]
        assert sampled and sampled == returned, "the loss-masked tokens are not the sampled tokens, in order"
        assert logps == [lp for c in policy.completions for lp in c.output_logprobs], \
            "rollout logprobs are not the engine's"

    def test_trajectories_carry_the_verifiers_reward(self, episode) -> None:
        trajs, _, session = episode
        assert session.scored >= 1, "the harness never asked the environment to score"
        for t in trajs:
            if t.status in (Status.COMPLETED, Status.TRUNCATED):
                assert t.reward == ContractSession.reward, f"reward {t.reward}, the verifier said {session.reward}"
