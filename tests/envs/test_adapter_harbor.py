"""Harbor adapter: the shipped task folder runs as a Harbor trial (Harbor's own Trial runner and
verifier, in a Python 3.12 venv) with our bubblewrap local environment provider and an agent that
talks to the proxy; Harbor's reward comes back on a TITO trajectory.

Cold: the harbor venv (~4 min on a loaded 2-core box, cached after); warm: ~20 s per test."""

from __future__ import annotations

import shutil

import pytest

from miles_agent.envs.external.adapters import HarborEnv
from miles_agent.types import Status
from tests.envs.adapter_helpers import model_texts, play

pytest.importorskip("aiohttp")
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="the local Harbor provider needs bubblewrap")


@pytest.mark.parametrize(("replies", "reward"), [
    (["echo hello > /app/greeting.txt", "DONE"], 1.0),
    (["echo goodbye > /app/greeting.txt", "DONE"], 0.0),
])
def test_harbor_trial_returns_harbor_verifier_reward(tokenizer, scripted, replies, reward):
    env = HarborEnv()
    assert [t.id for t in env.tasks()] == ["write-greeting"]
    policy = scripted(list(replies))
    (traj,) = play(env, tokenizer, policy, max_new_tokens=64)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == reward
    assert model_texts(traj, tokenizer) == replies  # the agent's second turn extends the same branch
    assert traj.loss_mask.count(1) == sum(len(ids) for ids in policy.sampled)
