"""OpenEnv adapter: the example OpenEnv environment plays through the proxy, in-process and over
OpenEnv's own WebSocket server, and the trajectory carries OpenEnv's reward for what was sampled.

The openenv venv is created on first use (cached under $MILES_AGENT_CACHE, ~1-2 min cold)."""

from __future__ import annotations

import pytest

from miles_agent.envs.external.adapters import OpenEnvEnv
from miles_agent.types import Status
from tests.envs.adapter_helpers import model_texts, play

pytest.importorskip("aiohttp")


def letter_score(word: str, reply: str) -> float:  # the example env's rule, restated
    return len(set(word) & set(reply.lower())) / len(set(word))


@pytest.mark.parametrize("mode", ["inprocess", "server"])
def test_openenv_scripted_episode_gets_openenv_step_rewards(tokenizer, scripted, mode):
    env = OpenEnvEnv(mode=mode)
    assert [t.id for t in env.tasks()] == ["0", "1", "2", "3", "4", "5"]
    policy = scripted(["pal", "apple"])  # task 0 asks for "apple": 3/4 of its letters, then all of them
    (traj,) = play(env, tokenizer, policy, task_index=0)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == pytest.approx(0.75 + 1.0)
    assert traj.reward_parts == {"steps": 2.0, "done": 1.0}
    assert model_texts(traj, tokenizer) == ["pal", "apple"]
    assert sum(traj.loss_mask) == sum(len(ids) for ids in policy.sampled)


def test_openenv_tiny_model_episode_is_tito_and_scored_by_openenv(tokenizer):
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.models.builder import build_tiny

    model, tok = build_tiny("tiny-qwen3")
    env = OpenEnvEnv()
    (traj,) = play(env, tok, EmbeddedEngine(model, tok), task_index=1, max_new_tokens=8)  # "river"
    traj.validate()
    assert traj.status in (Status.COMPLETED, Status.TRUNCATED), traj.metadata
    texts = model_texts(traj, tok)
    assert 1 <= len(texts) <= 2 and traj.reward_parts["steps"] == len(texts)
    assert traj.reward == pytest.approx(sum(letter_score("river", t) for t in texts))
