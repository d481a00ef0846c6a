"""Verifiers adapter: the example verifiers.v1 taskset runs through verifiers' own episode machinery
(Env.run_slot, its `null` chat harness in the subprocess runtime, its interception server) against the
proxy; the trajectory is what was sampled and its reward is the taskset's reward function.

Cold cost: the verifiers venv plus verifiers' own `uv sync --script` for its chat program (~5 min
on a loaded 2-core box), hence slow; warm (cached venv) it takes seconds."""

from __future__ import annotations

import pytest

from miles_agent.envs.external.adapters import VerifiersEnv
from miles_agent.types import Status
from tests.envs.adapter_helpers import model_texts, play

pytest.importorskip("aiohttp")


def test_verifiers_episode_scored_by_the_taskset_reward(tokenizer, scripted):
    env = VerifiersEnv()
    assert [t.id for t in env.tasks()] == ["apple", "river", "cloud", "stone", "light", "bread"]
    policy = scripted(["pal"])  # "apple": 3 of its 4 distinct letters
    (traj,) = play(env, tokenizer, policy, task_index=0)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == pytest.approx(0.75) and traj.reward_parts == {"letters": pytest.approx(0.75)}
    assert model_texts(traj, tokenizer) == ["pal"]
    assert traj.loss_mask.count(1) == len(policy.sampled[0])


def test_verifiers_tiny_model_episode(tokenizer):
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    model, tok = build_tiny("tiny-qwen3")
    env = VerifiersEnv()
    (traj,) = play(env, tok, EmbeddedEngine(model, tok), task_index=2, max_new_tokens=8)  # "cloud"
    traj.validate()
    assert traj.status in (Status.COMPLETED, Status.TRUNCATED), traj.metadata
    (text,) = model_texts(traj, tok)
    expected = len(set("cloud") & set(text.strip().lower())) / len(set("cloud"))
    assert traj.reward == pytest.approx(expected)
