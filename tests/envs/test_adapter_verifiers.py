"""Verifiers adapter: the example verifiers.v1 taskset runs through verifiers' own episode machinery
(Env.run_slot, its `null` chat harness in the subprocess runtime, its interception server) against the
proxy; the trajectory is what was sampled and its reward is the taskset's reward function.

Cold cost: the verifiers venv plus verifiers' own `uv sync --script` for its chat program (~5 min
on a loaded 2-core box), hence slow; warm (cached venv) it takes seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
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


ENVS = Path(__file__).parents[1] / "fixtures" / "verifiers_envs"


def verifiers_env(*options):
    return build_env(load_config(overrides=["env.name=verifiers", f"env.options.path={ENVS}", *options]))


@pytest.mark.parametrize(("reply", "reward"), [("41", 1.0), ("14", 0.0)])
def test_an_infinite_taskset_lists_a_bound_and_takes_its_own_settings(tokenizer, scripted, reply, reward):
    env = verifiers_env("env.options.id=miles_counting", "env.options.harness=null", "env.options.args.start=40",
                        "env.options.num_tasks=3")
    assert [t.id for t in env.tasks()] == ["count-40", "count-41", "count-42"]  # start=40 reached the taskset
    (traj,) = play(env, tokenizer, scripted([reply]), task_index=1)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == reward
    assert traj.reward_parts == {"exact": reward, "reply_chars": 2.0}  # metrics are kept next to rewards


def test_an_infinite_taskset_without_num_tasks_lists_the_default_bound():
    from miles_agent.envs.external.verifiers_side import INFINITE_TASKS

    env = verifiers_env("env.options.id=miles_counting", "env.options.harness=null")
    assert len(env.tasks()) == INFINITE_TASKS


def test_a_two_player_env_with_its_own_config_class_gives_each_player_its_reward(tokenizer, scripted):
    env = verifiers_env("env.options.id=miles_duel", "env.options.env_args.target=pear")
    red_right, blue_wrong = "pear", "plum"
    trajs = play(env, tokenizer, scripted([red_right, blue_wrong]))
    assert len(trajs) == 2, [t.metadata for t in trajs]  # one trajectory per player
    by_player = {t.metadata["player"]: t for t in trajs}
    assert by_player["red"].reward == 1.0 and by_player["blue"].reward == 0.0  # target=pear reached the env
    assert by_player["red"].reward_parts == {"win": 1.0, "reply_len": 4.0}
    for t in trajs:
        t.validate()
        assert t.status is Status.COMPLETED


def test_policy_oracle_plays_the_reference_answers():
    import asyncio

    from miles_agent.evaluate import evaluate

    cfg = load_config("tiny-cpu", ["env.name=verifiers", f"env.options.path={ENVS}", "env.options.id=miles_counting",
                                   "env.options.harness=null", "env.options.num_tasks=2"])
    assert asyncio.run(evaluate(cfg, policy="oracle"))["reward_mean"] == 1.0
