"""The parts every stage builds from a config: the choice check, the environment, its harness, its
sandboxes.

RL (loop.py), SFT, distillation, warm start, eval and replay all start here rather than from one
another, and reach plug-ins only through the registry. `check_choices` runs first: every key that
picks something (a plug-in name, an algorithm, a mode) is checked before any model loads or actor
starts, so a typo costs a second, not a model load. So are the plug-ins' own options: each declares what
it takes (a sandbox or an environment its ``options_type``, an environment or harness its ``env_keys``);
nothing is read off a constructor's signature.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from miles_agent import plugins, registry
from miles_agent.config import Config, EnvConfig, closest, typed
from miles_agent.engine import SamplingParams
from miles_agent.environment import Environment, HarnessLimits
from miles_agent.errors import UserError

DEFAULT_HARNESS = "chat-tools"
EMBEDDED_ENGINE = "embedded"  # the engine eval and a distillation teacher run in this process


def check_choices(cfg: Config) -> None:
    """Every choice key names something that exists and fits the others; raises UserError naming the key."""
    from miles_agent.algorithms import distill, losses, mismatch
    from miles_agent.algorithms.estimators import check_estimator
    from miles_agent.components import offload_enabled
    from miles_agent.scheduling import check_config as check_scheduling
    from miles_agent.sinks import parse_sinks
    from miles_agent.validation import check_values

    check_values(cfg)  # every number in its range (miles_agent/validation.py)
    check_device(cfg.model.device)
    check_scheduling(cfg.rollout)
    check_estimator(cfg.algo, cfg.rollout.samples_per_prompt)
    losses.validate_options(cfg.algo)
    mismatch.check_options(cfg.algo)
    if cfg.algo.distill_teacher is not None:
        distill.check_mode(cfg.algo.distill_mode)
    parse_sinks(plugins.split_sinks(cfg.run.sinks)[0])  # module:Class sinks: plugins.check_config
    plugins.check_config(cfg)  # every module:attr key loads and takes its documented call
    offload_enabled(cfg.train.offload, colocate=cfg.cluster.colocate, mode=cfg.cluster.mode)
    if cfg.train.pack_sequences not in (True, False, "auto"):  # the trainer resolves auto
        raise UserError(f"train.pack_sequences must be auto, true or false, got {cfg.train.pack_sequences!r}")
    if cfg.env.mix or cfg.env.name == "mix":  # envs/mix checks each of env.mix; returns cfg as env.name=mix
        cfg = registry.load("envs", "mix", key="env.mix").check(cfg)
    env = registry.load("envs", cfg.env.name, key="env.name")
    env_keys(f"environment {cfg.env.name!r}", env)
    env_options(cfg.env.name, env, cfg.env.options)
    harness = harness_name(cfg, env)
    env_keys(f"harness {harness!r}", registry.load("harnesses", harness, key="env.harness"))
    if getattr(env, "needs_sandbox", True):  # as env_sandboxes; a module:attr factory's env may need one
        sandbox_factory(cfg.env.sandbox, cfg.env.sandbox_options)
    registry.load("trainers", cfg.train.backend, key="train.backend")
    registry.load("engines", cfg.rollout.engine, key="rollout.engine")
    cluster = registry.load("clusters", cfg.cluster.mode, key="cluster.mode")
    if callable(getattr(cluster, "check", None)):
        cluster.check(cfg)


def build_env(cfg: Config, *, model_plays: bool = True) -> Environment:
    """The run's environment; ``model_plays=False`` when no model policy plays it (eval --policy oracle), so
    the built-in warm start's task set (`warm_start_options`) does not apply."""
    if cfg.env.mix or cfg.env.name == "mix":  # several environments: envs/mix builds each through build_env
        return registry.load("envs", "mix", key="env.mix").from_config(cfg)
    cls = registry.load("envs", cfg.env.name, key="env.name")
    kwargs: dict[str, Any] = {k: getattr(cfg.env, k) for k in env_keys(f"environment {cfg.env.name!r}", cls)}
    if cfg.env.tasks:
        if not Path(cfg.env.tasks).is_dir():
            raise UserError(f"--tasks {cfg.env.tasks} is not a folder; point it at a folder of task directories")
        kwargs["tasks_dir"] = cfg.env.tasks
    kwargs.update(env_options(cfg.env.name, cls, {**(warm_start_options(cfg, cls) if model_plays else {}), **cfg.env.options}))
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise UserError(f"environment {cfg.env.name!r} cannot be built with {kwargs or 'no arguments'} ({e})") from None


def warm_start_options(cfg: Config, cls: Any) -> dict[str, Any]:
    """The env options its built-in warm start was made with (its ``warm_start_options``), when the run starts
    from that warm start and no --tasks folder is given: the policy plays the tasks it was trained for."""
    builtin = cfg.model.warm_start == "builtin" and not cfg.model.hf_checkpoint and not cfg.env.tasks
    return dict(getattr(cls, "warm_start_options", None) or {}) if builtin else {}


def harness_name(cfg: Config, env: Environment | type[Environment]) -> str:
    """``env.harness``, else the environment's ``default_harness`` (a class attribute: known before it is built)."""
    return cfg.env.harness or getattr(env, "default_harness", DEFAULT_HARNESS)


def build_harness(cfg: Config, env: Environment, tokenizer: Any) -> Any:
    name = harness_name(cfg, env)
    limits = HarnessLimits(max_turns=cfg.env.max_turns, max_total_tokens=cfg.env.max_total_tokens,
                           max_new_tokens_per_turn=cfg.env.max_new_tokens_per_turn,
                           max_observation_tokens=cfg.env.max_observation_tokens)
    sampling = SamplingParams(max_new_tokens=cfg.env.max_new_tokens_per_turn, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    cls = registry.load("harnesses", name, key="env.harness")
    keys = {k: getattr(cfg.env, k) for k in env_keys(f"harness {name!r}", cls)}
    harness = cls(tokenizer, limits, sampling, **keys)
    lora = cfg.sections.get("lora")  # LoRA: each episode's requests go to its task's adapter
    return lora.wrap_harness(harness) if hasattr(lora, "wrap_harness") else harness


def env_keys(plugin: str, cls: Any) -> tuple[str, ...]:
    """The ``env.*`` keys ``cls`` declares it takes (its ``env_keys``), each checked to be one."""
    keys = tuple(getattr(cls, "env_keys", ()))  # a module:attr factory need not subclass the base
    valid = [f.name for f in dataclasses.fields(EnvConfig)]
    for key in keys:
        if key not in valid:
            close = closest(key, valid)
            raise UserError(f"{plugin} declares env_keys {key!r}, which is not an env.* config key"
                            f"{f'; did you mean {close!r}?' if close else ''} (valid: {', '.join(valid)})")
    return keys


def plugin_options(options_type: type, given: Mapping[str, Any], *, key: str, plugin: str, docs: str) -> Any:
    """``given`` as the plug-in's typed options (a dataclass): an unknown key or a wrong type is a
    UserError naming ``key`` (the config key holding them) and ``plugin``, with the valid keys."""
    valid = [f.name for f in dataclasses.fields(options_type)]
    for name in given:
        if name not in valid:
            close = closest(name, valid)
            raise UserError(f"{key}: {name} not accepted by the {plugin}; valid options: {', '.join(valid)}"
                            f"{f'; did you mean {close!r}?' if close else ''} (see {docs})")
    return typed(options_type, dict(given), key)


def env_options(name: str, cls: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """``env.options`` as the constructor keywords of environment ``cls``, typed by its ``options_type``
    (only the keys given: the environment keeps its own defaults for the rest)."""
    options_type = getattr(cls, "options_type", None)
    if not options or options_type is None:
        return dict(options or {})
    opts = plugin_options(options_type, options, key="env.options", plugin=f"{name!r} environment",
                          docs=getattr(cls, "options_docs", "the environment's docs"))
    return {k: getattr(opts, k) for k in options}


def sandbox_factory(name: str, options: Mapping[str, Any] | None = None) -> Callable[[], Any]:
    """The backend ``name`` as a zero-argument factory with ``options`` (``env.sandbox_options``) bound,
    checked against its ``options_type`` now (check_choices) so that a typo fails before any model loads."""
    cls = registry.load("sandboxes", name, key="env.sandbox")
    if not options:
        return cls
    options_type = getattr(cls, "options_type", None)
    if options_type is None:  # a backend that declares no options: they reach its constructor unchecked
        return functools.partial(cls, **options)
    opts = plugin_options(options_type, options, key="env.sandbox_options", plugin=f"{name!r} sandbox",
                          docs="docs/sandboxes.md")
    # Shallow: a nested dataclass option (RetryPolicy) reaches the constructor as itself.
    return functools.partial(cls, **{f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)})


def env_sandboxes(cfg: Config, env: Environment) -> Callable[[], Any] | None:
    """The sandbox factory episodes of ``env`` use, or None when its tasks need no sandbox."""
    return sandbox_factory(cfg.env.sandbox, cfg.env.sandbox_options) if env.needs_sandbox else None


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"the recipe asks for device {device!r} but no CUDA GPU is visible; "
                        "use a GPU machine or set model.device=cpu (e.g. --recipe tiny-cpu)")
