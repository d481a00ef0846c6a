"""The parts every stage builds from a config: the choice check, the environment, its harness, its
sandboxes.

RL (loop.py), SFT, distillation, warm start, eval and replay all start here rather than from one
another, and reach plug-ins only through the registry. `check_choices` runs first: every key that
picks something (a plug-in name, an algorithm, a mode) is checked before any model loads or actor
starts, so a typo costs a second, not a model load.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_agent import registry
from miles_agent.config import Config
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

    check_device(cfg.model.device)
    check_scheduling(cfg.rollout)
    check_estimator(cfg.algo, cfg.rollout.samples_per_prompt)
    losses.validate_options(cfg.algo)
    mismatch.check_options(cfg.algo)
    if cfg.algo.distill_teacher is not None:
        distill.check_mode(cfg.algo.distill_mode)
    parse_sinks(cfg.run.sinks)
    offload_enabled(cfg.train.offload, colocate=cfg.cluster.colocate, mode=cfg.cluster.mode)
    registry.load("envs", cfg.env.name, key="env.name")
    if cfg.env.harness:
        registry.load("harnesses", cfg.env.harness, key="env.harness")
    registry.load("trainers", cfg.train.backend, key="train.backend")
    registry.load("engines", cfg.rollout.engine, key="rollout.engine")
    cluster = registry.load("clusters", cfg.cluster.mode, key="cluster.mode")
    if callable(getattr(cluster, "check", None)):
        cluster.check(cfg)


def build_env(cfg: Config) -> Environment:
    cls = registry.load("envs", cfg.env.name, key="env.name")
    kwargs: dict[str, Any] = {}
    if "sandbox" in inspect.signature(cls).parameters:  # environments that route tasks by sandbox backend
        kwargs["sandbox"] = cfg.env.sandbox
    if cfg.env.tasks:
        if not Path(cfg.env.tasks).is_dir():
            raise UserError(f"--tasks {cfg.env.tasks} is not a folder; point it at a folder of task directories")
        kwargs["tasks_dir"] = cfg.env.tasks
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise UserError(f"environment {cfg.env.name!r} cannot be built with {kwargs or 'no arguments'} ({e})") from None


def build_harness(cfg: Config, env: Environment, tokenizer: Any) -> Any:
    name = cfg.env.harness or getattr(env, "default_harness", DEFAULT_HARNESS)
    limits = HarnessLimits(max_turns=cfg.env.max_turns, max_total_tokens=cfg.env.max_total_tokens,
                           max_new_tokens_per_turn=cfg.env.max_new_tokens_per_turn,
                           max_observation_tokens=cfg.env.max_observation_tokens)
    sampling = SamplingParams(max_new_tokens=cfg.env.max_new_tokens_per_turn, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    cls = registry.load("harnesses", name, key="env.harness")
    params = inspect.signature(cls).parameters
    agent = {k: getattr(cfg.env, k) for k in ("agent", "agent_timeout_s") if k in params}  # the black-box harness
    return cls(tokenizer, limits, sampling, **agent)


def sandbox_factory(name: str, options: dict[str, Any] | None = None) -> Callable[[], Any]:
    """The backend ``name`` as a zero-argument factory with ``options`` (``env.sandbox_options``) bound,
    checked against its constructor now so that a typo fails at startup, not in the first episode."""
    cls = registry.load("sandboxes", name, key="env.sandbox")
    if not options:
        return cls
    # RemoteSandbox options (ttl_s, retry) arrive through **kwargs: look at the whole class chain.
    known = {n for c in getattr(cls, "__mro__", [cls]) if "__init__" in vars(c)
             for n, p in inspect.signature(vars(c)["__init__"]).parameters.items()
             if n != "self" and p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UserError(f"env.sandbox_options: {', '.join(unknown)} not accepted by the {name!r} sandbox; "
                        f"valid options: {', '.join(sorted(known - {'sleep', 'sdk'}))} (see docs/sandboxes.md)")
    return functools.partial(cls, **options)


def env_sandboxes(cfg: Config, env: Environment) -> Callable[[], Any] | None:
    """The sandbox factory episodes of ``env`` use, or None when its tasks need no sandbox."""
    return sandbox_factory(cfg.env.sandbox, cfg.env.sandbox_options) if env.needs_sandbox else None


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"the recipe asks for device {device!r} but no CUDA GPU is visible; "
                        "use a GPU machine or set model.device=cpu (e.g. --recipe tiny-cpu)")
