"""Typed config: recipes plus overrides, unknown keys and wrong types named with the fix."""

from __future__ import annotations

import pytest

from miles_agent.config import Config, available_recipes, load_config
from miles_agent.errors import UserError


def test_recipe_then_overrides_then_flags():
    cfg = load_config("tiny-cpu", ["train.lr=1e-5", "run.steps=3", "algo.clip_eps_high=0.28"], {"run.seed": 7})
    assert isinstance(cfg, Config)
    assert cfg.train.lr == 1e-5 and cfg.run.steps == 3 and cfg.run.seed == 7
    assert cfg.algo.clip_eps_high == 0.28 and cfg.model.warm_start == "builtin"
    assert "tiny-cpu" in available_recipes()


@pytest.mark.parametrize("overrides, message", [
    (["train.lrr=1"], "did you mean 'train.lr'"),
    (["nosuch.x=1"], "unknown config key 'nosuch'"),
    (["run.steps=ten"], "must be an integer"),
    (["algo.normalize_std=maybe"], "must be true or false"),
    (["train.betas=[0.9]"], "list of 2 values"),
    (["steps=3"], "section.key=value"),
    (["run.steps"], "section.key=value"),
])
def test_bad_overrides_name_the_cause(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_malformed_recipe_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  arch: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML at line"):
        load_config(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="must be a mapping of sections"):
        load_config(str(bad))
    with pytest.raises(UserError, match="unknown recipe 'nope'"):
        load_config("nope")
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_renamed_values_are_still_read_with_a_warning(caplog):
    """"local" named the engine, the sandbox and the cluster mode; the engine and mode were renamed."""
    with caplog.at_level("WARNING", logger="miles_agent.config"):
        cfg = load_config(None, ["rollout.engine=local", "cluster.mode=local"])
    assert cfg.rollout.engine == "embedded" and cfg.cluster.mode == "inprocess" and cfg.env.sandbox == "local"
    assert "rollout.engine=local is now called rollout.engine=embedded" in caplog.text
    assert "cluster.mode=local is now called cluster.mode=inprocess" in caplog.text


def test_plugins_own_their_sections():
    """sglang and megatron are declared by their plug-ins (miles_agent.sections), read like the core's."""
    from miles_agent import registry

    owners = {p.name: p.target for p in registry.list_plugins("sections")}
    assert owners["sglang"].startswith("miles_agent.engines.sglang.") and \
        owners["megatron"].startswith("miles_agent.trainers.megatron.")
    cfg = load_config(None, ["megatron.tensor_parallel=2", "sglang.tp_size=4"])
    assert cfg.megatron.tensor_parallel == 2 and cfg.sglang.tp_size == 4 and Config().sglang.tp_size == 1
    again = load_config(None, {f"{s}.{k}": v for s, sec in cfg.to_dict().items() for k, v in sec.items()})
    assert again == cfg  # config.json (to_dict) reads back to the same config
    with pytest.raises(UserError, match="unknown config key 'megatron.tensor_paralel'"):
        load_config(None, ["megatron.tensor_paralel=2"])
