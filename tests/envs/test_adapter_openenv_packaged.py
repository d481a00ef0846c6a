"""OpenEnv adapter on envs in the shape of OpenEnv's own (tests/fixtures/openenv_envs): a packaged env
whose modules use relative imports and ship a server app, that is not concurrent-safe and takes its
question from a reset keyword; and an MCP-only env whose actions are tool calls. All configured the way
the command line does (`env.options.*`), run by the real openenv package in its venv."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_agent.build import build_env
from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.types import Status
from tests.envs.adapter_helpers import model_texts, play, play_all, tool_call

pytest.importorskip("aiohttp")
ENVS = Path(__file__).parents[1] / "fixtures" / "openenv_envs"
LETTERS = f"{ENVS}/letters_env/server/letters_environment.py:LettersEnvironment"
ROWS = '[{"question_id": 0}, {"question_id": 1}, {"question_id": 2}]'


def env_from(*options):
    return build_env(load_config(overrides=["env.name=openenv", *options]))


@pytest.mark.parametrize("mode", ["inprocess", "server"])
def test_a_packaged_env_runs_unchanged_with_reset_rows_right_and_wrong(tokenizer, scripted, mode):
    env = env_from(f"env.options.env={LETTERS}", f"env.options.reset={ROWS}", f"env.options.mode={mode}")
    assert [t.info["reset"] for t in env.tasks()] == [{"question_id": i} for i in range(3)]
    # concurrent rollouts of a non-concurrent env: played one at a time (the env raises on overlap)
    right, wrong, also_right = play_all(env, tokenizer, [scripted(["a"]), scripted(["b"]), scripted(["z"])])
    for (traj,), reward in ((right, 1.0), (wrong, 0.0), (also_right, 1.0)):
        assert traj.status is Status.COMPLETED, traj.metadata
        traj.validate()
        assert traj.reward == reward
    assert model_texts(wrong[0], tokenizer) == ["b"]


def test_a_packaged_env_by_module_name_with_path(tokenizer, scripted):
    env = env_from("env.options.env=letters_env.server.letters_environment:LettersEnvironment",
                   f"env.options.path={ENVS}", f"env.options.reset={ROWS}")
    (traj,) = play(env, tokenizer, scripted(["c"]), task_index=1)
    assert traj.status is Status.COMPLETED and traj.reward == 1.0, traj.metadata


@pytest.mark.parametrize(("answer", "reward"), [("29", 1.0), ("17", 0.0)])
def test_an_mcp_env_is_played_through_its_tools(tokenizer, scripted, answer, reward):
    env = env_from(f"env.options.env={ENVS}/lookup_env/server.py:LookupEnvironment",
                   'env.options.reset=[{"key": "beta"}]', "env.options.max_steps=3")
    policy = scripted([tool_call("lookup", key="beta"), tool_call("submit", answer=answer)])
    (traj,) = play(env, tokenizer, policy, max_new_tokens=96)
    assert traj.status is Status.COMPLETED, traj.metadata
    traj.validate()
    assert traj.reward == reward and traj.reward_parts["steps"] == 2.0
    text = tokenizer.decode(traj.tokens)
    assert "beta with the lookup tool" in text and "29" in text  # the reset's task and the tool's answer


def test_a_wrong_env_name_fails_the_listing_with_one_line():
    env = env_from(f"env.options.env={ENVS}/letters_env/server/letters_environment.py:NoSuchEnv")
    with pytest.raises(UserError) as err:
        env.tasks()
    assert "\n" not in str(err.value) and "has no 'NoSuchEnv'" in str(err.value)


def test_an_unknown_option_fails_before_anything_runs():
    from miles_agent.build import check_choices

    with pytest.raises(UserError, match=r"env.options: actoin not accepted by the 'openenv' environment; .*"
                                        r"did you mean 'action'"):
        check_choices(load_config("tiny-cpu", ["env.name=openenv", "env.options.actoin=x"]))
