"""Harbor adapter: the shipped task folder runs as a Harbor trial (Harbor's own Trial runner and
verifier, in a Python 3.12 venv) with our bubblewrap local environment provider and an agent that
talks to the proxy; Harbor's reward comes back on a TITO trajectory.

Cold: the harbor venv (~4 min on a loaded 2-core box, cached after); warm: ~20 s per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
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


TASKS = Path(__file__).parents[1] / "fixtures" / "harbor_tasks"


def harbor_env(*options, tasks=TASKS):
    return build_env(load_config(overrides=["env.name=harbor", f"env.tasks={tasks}", *options]))


def test_a_multi_key_reward_json_keeps_every_key_as_a_part(tokenizer, scripted):
    env = harbor_env("env.options.reward_key=correct")
    assert [t.id for t in env.tasks()] == ["multi-score", "skilled"]
    (traj,) = play(env, tokenizer, scripted(["echo 42 > /app/answer.txt\n", "DONE"]), max_new_tokens=64)
    assert traj.status is Status.COMPLETED, traj.metadata
    assert traj.reward == 1.0 and traj.reward_parts == {"tidy": 1.0}
    # the reply went back as generated (trailing newline and all): one history, one trajectory
    assert model_texts(traj, tokenizer) == ["echo 42 > /app/answer.txt\n", "DONE"]


def test_several_keys_and_no_reward_key_is_named_not_guessed(tokenizer, scripted):
    (traj,) = play(harbor_env(), tokenizer, scripted(["echo 42 > /app/answer.txt", "DONE"]), max_new_tokens=64)
    assert traj.status is Status.FAILED
    assert "keys ['correct', 'tidy'] and no 'reward'" in traj.metadata["error"]
    assert "env.options.reward_key=KEY" in traj.metadata["error"]


def test_the_proxy_shell_agent_declares_skills_and_names_them(tokenizer, scripted):
    env = harbor_env()
    policy = scripted(["echo hello | tr a-z A-Z > /app/out.txt", "DONE"])
    (traj,) = play(env, tokenizer, policy, task_index=1, max_new_tokens=64)
    assert traj.status is Status.COMPLETED and traj.reward == 1.0, traj.metadata
    assert "Skills are available in /app/skills: shout" in tokenizer.decode(traj.prompt_ids)


def test_policy_oracle_runs_harbors_oracle_agent():
    import asyncio

    from miles_agent.evaluate import evaluate

    cfg = load_config("tiny-cpu", ["env.name=harbor"])  # the shipped task: its solution/solve.sh
    assert asyncio.run(evaluate(cfg, policy="oracle"))["reward_mean"] == 1.0
