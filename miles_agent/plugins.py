"""User Python by dotted path (``module:attr``): rewards, advantages, losses, filters, rollouts, hooks, sinks.

Each config key that takes user code names one *kind* in `KINDS`, with the call it must accept. `load`
imports the object and binds that call against ``inspect.signature`` at start (check_choices), so a bad
path or a function that cannot take the call fails in one line naming the key, the path and the expected
signature, before any model loads. Functions may be sync or ``async def``; `call` awaits either.
docs/extensions.md has a runnable example of each.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_agent.errors import UserError


@dataclass(frozen=True)
class Kind:
    signature: str  # as documented, named in the error
    args: tuple[str, ...] = ()  # positional arguments the call passes
    kwargs: tuple[str, ...] = ()  # keyword arguments the call passes


KINDS: dict[str, Kind] = {
    "env.reward": Kind("fn(task, messages, env_reward) -> float | Reward", ("task", "messages", "env_reward")),
    "env.group_reward": Kind("fn(task, responses, trajectories) -> list[float]",
                             ("task", "responses", "trajectories")),
    "env.reward_post": Kind("fn(rewards, trajectories) -> list[float]", ("rewards", "trajectories")),
    "algo.advantage": Kind("fn(rewards, group_ids, *, trajectories, algo) -> list[float] | list[list[float]]",
                           ("rewards", "group_ids"), ("trajectories", "algo")),
    "algo.loss": Kind("fn(logp, old_logp, advantages, *, mask, clip_eps, clip_eps_high, dual_clip_c) "
                      "-> (per-token loss, clipped | None)", ("logp", "old_logp", "advantages"),
                      ("mask", "clip_eps", "clip_eps_high", "dual_clip_c")),
    "algo.loss_agg": Kind("fn(values, mask, *, num_tokens, num_seqs, row_weights) -> scalar tensor",
                          ("values", "mask"), ("num_tokens", "num_seqs", "row_weights")),
    "algo.loss_mask_filter": Kind("fn(trajectory) -> bool | list[int]", ("trajectory",)),
    "rollout.group_filter": Kind("fn(group) -> bool", ("group",)),
    "rollout.buffer_filter": Kind("fn(trajectories) -> list[Trajectory]", ("trajectories",)),
    "rollout.function": Kind("async fn(ctx: RolloutContext) -> list[Trajectory]", ("ctx",)),
}

NAMED = ("algo.advantage", "algo.loss", "algo.loss_agg")
HOOKS = ("on_run_start", "after_rollout", "before_train_step", "after_train_step", "after_weight_sync",
         "on_checkpoint", "on_run_end")
HOOK_ARGS = {"on_run_start": ("run",), "after_rollout": ("step", "trajectories"),
             "before_train_step": ("step", "batch"), "after_train_step": ("step", "metrics"),
             "after_weight_sync": ("step", "version"), "on_checkpoint": ("step", "path"),
             "on_run_end": ("run", "records")}
SINK_SIGNATURE = "class Sink(run_dir, config, resume) with write(record) and close()"


def is_path(value: str | None) -> bool:
    return bool(value) and ":" in str(value)


def import_path(key: str, path: str) -> Any:
    """The object ``module:attr`` names; a UserError naming ``key`` and ``path`` when it does not exist."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"{key}={path}: not a dotted path; write module:attr (e.g. mypkg.rewards:score)")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{key}={path}: cannot load it ({type(e).__name__}: {e}); check the module path "
                        "and that its folder is on PYTHONPATH") from None
    return obj


def check_call(key: str, path: str, fn: Any, signature: str, args: tuple[str, ...],
               kwargs: tuple[str, ...] = ()) -> None:
    """``fn`` accepts the call (``args`` positionally, ``kwargs`` by keyword), else a one-line UserError."""
    if not callable(fn):
        raise UserError(f"{key}={path}: {type(fn).__name__} is not callable; expected {signature}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind(*args, **dict.fromkeys(kwargs))
    except TypeError as e:
        raise UserError(f"{key}={path}: signature {fn.__name__ if hasattr(fn, '__name__') else fn}{sig} "
                        f"does not fit ({e}); expected {signature}") from None


@functools.cache
def load(key: str, path: str) -> Callable[..., Any]:
    """The user function at ``path`` for config key ``key`` (a `KINDS` entry), its signature checked."""
    kind = KINDS[key]
    fn = import_path(key, path)
    check_call(key, path, fn, kind.signature, kind.args, kind.kwargs)
    return fn


def maybe(key: str, path: str | None) -> Callable[..., Any] | None:
    return load(key, path) if path else None


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a sync or async user function and return its value."""
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def split_list(text: str) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


# -- hooks and sinks -----------------------------------------------------------------------------------

class Hooks:
    """``run.hooks=mod:obj[,mod2:obj2]``: objects (a class is instantiated with no arguments; a module
    works too) with any of the `HOOKS` methods. A method may return a dict of numbers: they are logged
    in the step's record as ``hooks/<key>`` (on_run_start: the first step's; on_checkpoint: the next
    step's; on_run_end and the last checkpoint: ``RUN_DIR/hooks_final.json``)."""

    def __init__(self, text: str) -> None:
        self.objects: list[tuple[str, Any]] = []
        for path in split_list(text):
            obj = import_path("run.hooks", path)
            if inspect.isclass(obj):
                obj = obj()
            found = [h for h in HOOKS if callable(getattr(obj, h, None))]
            if not found:
                raise UserError(f"run.hooks={path}: has none of the hook methods; define one of {', '.join(HOOKS)}")
            for name in found:
                check_call("run.hooks", f"{path}.{name}", getattr(obj, name), f"{name}({', '.join(HOOK_ARGS[name])})",
                           HOOK_ARGS[name])
            self.objects.append((path, obj))
        self.pending: dict[str, float] = {}  # metrics waiting for the next record

    async def fire(self, name: str, *args: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for path, obj in self.objects:
            method = getattr(obj, name, None)
            if method is None:
                continue
            got = await call(method, *args)
            if got is None:
                continue
            if not isinstance(got, dict):
                raise TypeError(f"run.hooks {path}.{name} returned {type(got).__name__}; return a dict of metrics or None")
            out.update({f"hooks/{k}": v for k, v in got.items()})
        return out


def split_sinks(text: str) -> tuple[str, list[str]]:
    """``run.sinks`` as (the built-in names, comma-joined; the ``module:Class`` sinks)."""
    parts = split_list(text)
    return ",".join(p for p in parts if not is_path(p)), [p for p in parts if is_path(p)]


def check_sink(path: str) -> Any:
    cls = import_path("run.sinks", path)
    check_call("run.sinks", path, cls, SINK_SIGNATURE, (), ("run_dir", "config", "resume"))
    for method in ("write", "close"):
        if not callable(getattr(cls, method, None)):
            raise UserError(f"run.sinks={path}: has no {method}() method; expected {SINK_SIGNATURE}")
    return cls


def build_user_sinks(paths: list[str], run_dir: Any, config: dict[str, Any], resume: bool) -> list[Any]:
    return [check_sink(p)(run_dir=run_dir, config=config, resume=resume) for p in paths]


def check_config(cfg: Any) -> None:
    """Every dotted-path key of ``cfg`` loads and takes its call (check_choices runs it first)."""
    for key in KINDS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name, "")
        if is_path(value) or (value and key not in NAMED):  # NAMED keys also take a built-in name
            load(key, value)
    Hooks(cfg.run.hooks)
    for path in split_sinks(cfg.run.sinks)[1]:
        check_sink(path)
