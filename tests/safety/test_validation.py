"""Every numeric config value is checked in the one build step: a bad one fails in a second, before any
model loads, naming the key, the value, the range and a fix -- no hang, no traceback, no useless run."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from miles_agent.build import check_choices
from miles_agent.cli import main
from miles_agent.config import Config, available_recipes, load_config
from miles_agent.errors import UserError
from miles_agent.validation import RANGES, check_values

CORE = [f.name for f in dataclasses.fields(Config) if f.name != "sections"]


def _numeric(tp) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args) or any(_numeric(a) for a in typing.get_args(tp))


def test_every_numeric_key_of_the_core_sections_has_a_declared_range():
    hints = typing.get_type_hints(Config)
    missing = []
    for section in CORE:
        cls = hints[section]
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if _numeric(tp) and tp is not bool and f"{section}.{f.name}" not in RANGES:
                missing.append(f"{section}.{f.name}")
    assert not missing, f"add these to miles_agent/validation.py RANGES: {missing}"
    assert all(k.split(".")[0] in CORE for k in RANGES), "a RANGES entry names no section"


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_shipped_recipe_and_the_defaults_are_in_range(recipe):
    check_values(load_config(recipe))
    check_values(Config())


@pytest.mark.parametrize("override, fragment", [
    ("rollout.samples_per_prompt=-1", ">= 1"),  # used to leave the event loop idle forever
    ("rollout.prompts_per_step=0", ">= 1"),
    ("train.lr=-1", "> 0"),
    ("train.lr=.nan", "> 0"),
    ("run.steps=0", ">= 1"),  # used to write an untrained final model
    ("train.micro_batch_tokens=0", ">= 1"),
    ("rollout.top_p=0", "> 0 and <= 1"),
    ("train.betas=[0.9, 1.5]", "< 1"),
    ("algo.gamma=1.5", "<= 1"),
    ("sync.master_port=70000", "<= 65535"),
])
def test_an_out_of_range_value_names_key_value_range_and_fix(override, fragment):
    key, value = override.split("=")
    with pytest.raises(UserError) as e:
        check_choices(load_config("tiny-cpu", [override]))
    msg = str(e.value)
    assert msg.startswith(f"{key}=") and "out of range" in msg and fragment in msg
    assert f"set e.g. {key}=" in msg  # the fix: a valid value to use
    assert "\n" not in msg


def test_a_crossed_pair_and_a_bad_choice_are_refused():
    with pytest.raises(UserError, match="mismatch_low"):
        check_values(load_config(None, ["algo.mismatch_low=3", "algo.mismatch_high=2"]))
    with pytest.raises(UserError, match="env.reward_out_of_range='wrap'"):
        check_values(load_config(None, ["env.reward_out_of_range=wrap"]))


def test_a_plugin_section_can_declare_its_own_ranges(monkeypatch):
    from miles_agent.validation import Range

    @dataclasses.dataclass(frozen=True)
    class Extra:
        ranges: typing.ClassVar = {"workers": Range(1, what="processes")}
        workers: int = 2

    cfg = dataclasses.replace(Config(), sections={"extra": Extra(workers=0)})
    with pytest.raises(UserError, match=r"extra.workers=0 .* >= 1 \(processes\); set e.g. extra.workers=2"):
        check_values(cfg)
    check_values(dataclasses.replace(Config(), sections={"extra": Extra()}))


def test_the_cli_answers_in_one_line_before_loading_anything(capsys, tmp_path):
    code = main(["train", "--env", "arith-tools", "--run-dir", str(tmp_path / "r"), "rollout.samples_per_prompt=-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "rollout.samples_per_prompt=-1" in err
    assert not (tmp_path / "r").exists()  # nothing was written


def test_inf_is_allowed_where_it_means_no_limit():
    cfg = load_config(None, ["env.agent_timeout_s=.inf", "train.grad_clip=.inf"])
    assert math.isinf(cfg.env.agent_timeout_s)
    check_values(cfg)


@pytest.mark.parametrize("override", ["train.lr=.inf", "rollout.temperature=.inf", "algo.kl_coef=.inf"])
def test_inf_is_refused_where_it_means_nothing(override):
    # train.lr=inf used to be accepted (inf > 0) and trained the weights into NaN
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"{key}=inf is not a finite number; set e.g. {key}="):
        check_values(load_config(None, [override]))
