"""`env.options`: one shape for every adapter, set on the command line (nested with dots) or in a recipe,
typed by the environment's `options_type`, refused before anything is built when a key is unknown."""

from __future__ import annotations

import asyncio

import pytest

from miles_agent import loop
from miles_agent.build import build_env, check_choices
from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.models import loading


@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a part was built before the bad option was refused")

    monkeypatch.setattr(loading, "load_policy", refuse)
    monkeypatch.setattr(loop, "build_env", refuse)


def test_nested_overrides_build_the_options_mapping():
    cfg = load_config(overrides=["env.name=verifiers", "env.options.id=my-env", "env.options.args.difficulty=hard",
                                 "env.options.args.rounds=3", "env.options.num_tasks=5"])
    assert cfg.env.options == {"id": "my-env", "args": {"difficulty": "hard", "rounds": 3}, "num_tasks": 5}


def test_overrides_merge_into_a_recipes_options(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("env:\n  name: verifiers\n  options:\n    id: my-env\n    args: {difficulty: easy, rounds: 2}\n")
    cfg = load_config(str(recipe), ["env.options.args.difficulty=hard"])
    assert cfg.env.options == {"id": "my-env", "args": {"difficulty": "hard", "rounds": 2}}


def test_an_override_into_a_value_that_is_not_a_mapping_is_named():
    with pytest.raises(UserError, match=r"env.options.id is not a mapping"):
        load_config(overrides=["env.options.id=x", "env.options.id.sub=y"])


@pytest.mark.parametrize("env", ["verifiers", "openenv", "hud", "harbor", "nemo-gym"])
def test_an_unknown_option_fails_before_any_model_or_env_is_built(nothing_built, tmp_path, env):
    cfg = load_config("tiny-cpu", [f"env.name={env}", f"run.run_dir={tmp_path}", "env.options.no_such_key=1"])
    with pytest.raises(UserError, match=rf"env.options: no_such_key not accepted by the '{env}' environment; "
                                        r"valid options: .*\(see docs/ecosystem.md\)"):
        loop.Run(cfg)


def test_a_wrong_type_names_the_key_and_the_value():
    with pytest.raises(UserError, match=r"'env.options.num_tasks' must be an integer, got 'many'"):
        check_choices(load_config("tiny-cpu", ["env.name=verifiers", "env.options.num_tasks=many"]))


def test_options_reach_the_adapter_typed_over_its_defaults():
    env = build_env(load_config(overrides=["env.name=openenv", 'env.options.reset=[{"seed": 3}]',
                                           "env.options.max_steps=9", "env.options.packages=[my-env==1.0]"]))
    assert env.config["reset"] == ({"seed": 3},) and env.config["max_steps"] == 9
    assert env.config["env"].endswith("openenv_spell.py:SpellEnv")  # the default the user did not override
    assert env.venv.requirements == ("openenv==0.10.0", "my-env==1.0")  # a venv of its own, keyed by the pins


def test_an_environment_without_options_type_takes_them_unchecked(monkeypatch):
    from miles_agent import registry
    from miles_agent.environment import Environment

    class Plain(Environment):
        name = "plain"

        def __init__(self, level: int = 0) -> None:
            self.level = level

        def tasks(self, split="train"):
            return []

        async def open(self, task, sandbox=None):
            raise AssertionError("never played here")

    real = registry.load
    monkeypatch.setattr(registry, "load", lambda group, name, **kw: Plain if name == "plain" else real(group, name, **kw))
    assert build_env(load_config(overrides=["env.name=plain", "env.options.level=4"])).level == 4
    with pytest.raises(UserError, match=r"cannot be built with \{'colour': 1\}"):
        build_env(load_config(overrides=["env.name=plain", "env.options.colour=1"]))


@pytest.mark.parametrize("env", ["openenv", "hud"])
def test_oracle_is_refused_in_one_line_where_the_ecosystem_has_none(env):
    """OpenEnv and HUD publish no reference solutions: `--policy oracle` stops before listing any task."""
    from miles_agent.evaluate import evaluate

    with pytest.raises(UserError, match=f"--policy oracle on {env}: the ecosystem publishes no reference solution"):
        asyncio.run(evaluate(load_config("tiny-cpu", [f"env.name={env}"]), policy="oracle"))
