"""Plug-ins declare what they take: a sandbox backend its typed options (``options_type``), an environment
or harness its ``env_keys``. The build step checks them before any model loads (build.check_choices)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import pytest

from miles_agent import loop, registry
from miles_agent.build import build_env, build_harness, env_sandboxes, sandbox_factory
from miles_agent.config import load_config
from miles_agent.errors import UserError
from miles_agent.models import loading

BACKENDS = ["local", "docker", "e2b", "modal", "daytona"]


@pytest.fixture
def nothing_built(monkeypatch):
    """Building the environment, the model or the tokenizer fails the test: the check must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a part was built before the bad option was refused")

    monkeypatch.setattr(loading, "load_policy", refuse)  # the model and the tokenizer
    monkeypatch.setattr(loop, "build_env", refuse)


def run_with(tmp_path, *overrides):
    return loop.Run(load_config("tiny-cpu", ["env.name=terminal-bench", f"run.run_dir={tmp_path}", *overrides]))


def test_a_typo_in_sandbox_options_fails_with_a_suggestion_before_anything_is_built(nothing_built, tmp_path):
    with pytest.raises(UserError, match=r"env.sandbox_options: isolaton not accepted by the 'local' sandbox; "
                                        r"valid options: isolation, .*verifier_disk_inodes; did you mean 'isolation'\?"):
        run_with(tmp_path, 'env.sandbox_options={"isolaton": "none"}')


def test_a_wrong_type_in_sandbox_options_names_key_type_and_value(nothing_built, tmp_path):
    with pytest.raises(UserError, match=r"'env.sandbox_options.verifier_disk_bytes' must be an integer, got 'big'"):
        run_with(tmp_path, 'env.sandbox_options={"verifier_disk_bytes": "big"}')
    with pytest.raises(UserError, match=r"'env.sandbox_options.tmp_bytes' must be an integer, got 1.5"):
        run_with(tmp_path, "env.sandbox=docker", 'env.sandbox_options={"tmp_bytes": 1.5}')


def test_valid_options_reach_the_backend_typed():
    cfg = load_config(overrides=["env.name=terminal-bench",
                                 'env.sandbox_options={"isolation": "none", "extra_ro_binds": ["/opt"]}'])
    sb = env_sandboxes(cfg, build_env(cfg))()
    assert (sb.isolation, sb._extra_ro_binds) == ("none", ("/opt",))
    docker = sandbox_factory("docker", {"ttl_s": 5, "retry": {"attempts": 2}})()
    assert (docker.ttl_s, docker.retry.attempts) == (5.0, 2)  # a mapping becomes the RetryPolicy
    policy = type(docker.retry)(attempts=1)
    assert sandbox_factory("docker", {"retry": policy})().retry is policy  # one already built is kept
    assert sandbox_factory("local", {}) is registry.load("sandboxes", "local")


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_option_is_a_constructor_keyword_with_the_same_default(backend):
    """The options dataclass mirrors the constructor (RemoteSandbox's ttl_s / retry arrive via **kwargs)."""
    cls = registry.load("sandboxes", backend)
    keywords = {n: p.default for c in reversed(cls.__mro__) if "__init__" in vars(c)
                for n, p in inspect.signature(vars(c)["__init__"]).parameters.items() if p.kind is p.KEYWORD_ONLY}
    for f in dataclasses.fields(cls.options_type):
        assert f.name in keywords, f"{backend}: option {f.name} is no constructor keyword"
        assert f.default == keywords[f.name], f"{backend}: {f.name} defaults differ"


class LegacySandbox:
    """A third-party backend from before options_type: its options reach it unchecked, as before."""

    def __init__(self, *, flavour: str = "plain") -> None:
        self.flavour = flavour


@pytest.fixture
def plugin_module(monkeypatch):
    module = types.ModuleType("third_party_plugins")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_backend_without_options_type_gets_its_options_as_keywords(plugin_module):
    plugin_module.LegacySandbox = LegacySandbox
    assert sandbox_factory("third_party_plugins:LegacySandbox", {"flavour": "spicy"})().flavour == "spicy"


def test_declared_env_keys_reach_the_plugins():
    cfg = load_config(overrides=["env.name=terminal-bench", "env.sandbox=docker", "env.harness=black-box",
                                 "env.agent=echo", "env.agent_timeout_s=5"])
    assert build_env(cfg).sandbox == "docker"
    harness = build_harness(cfg, build_env(cfg), tokenizer=None)
    assert (harness.agent, harness.agent_timeout_s) == (["echo"], 5.0)  # the command line, as argv


def test_a_declared_env_key_that_does_not_exist_is_refused_before_anything_is_built(nothing_built, plugin_module,
                                                                                     tmp_path):
    chat_tools = registry.load("harnesses", "chat-tools")
    plugin_module.Harness = type("Harness", (chat_tools,), {"env_keys": ("agent_timeout",)})
    with pytest.raises(UserError, match=r"harness 'third_party_plugins:Harness' declares env_keys 'agent_timeout', "
                                        r"which is not an env.\* config key; did you mean 'agent_timeout_s'\?"):
        run_with(tmp_path, "env.harness=third_party_plugins:Harness")
