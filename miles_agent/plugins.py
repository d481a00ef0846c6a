"""User Python by dotted path (``module:attr``): rewards, advantages, losses, filters, rollouts, hooks, sinks.

Each key in `KINDS` names the call its function must take; `load` binds that call against
``inspect.signature`` when check_choices runs, so a bad path or signature fails in one line naming the
key, the path and the expected call before any model loads. Functions may be sync or ``async def``.
Examples of each: docs/extensions.md.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_agent.environment import Reward, Task
from miles_agent.errors import UserError
from miles_agent.registry import resolve_attr
from miles_agent.types import Status, Trajectory

KINDS = {  # key -> the call; names before "*" are passed by position, after it by keyword
    "env.reward": "fn(task, messages, env_reward) -> float | Reward",
    "env.group_reward": "fn(task, responses, trajectories) -> list[float]",
    "env.reward_post": "fn(rewards, trajectories) -> list[float]",
    "algo.advantage": "fn(rewards, group_ids, *, trajectories, algo) -> list[float] | list[list[float]]",
    "algo.loss": "fn(logp, old_logp, advantages, *, mask, clip_eps, clip_eps_high, dual_clip_c) -> (loss, clipped)",
    "algo.loss_agg": "fn(values, mask, *, num_tokens, num_seqs, row_weights) -> scalar tensor",
    "algo.loss_mask_filter": "fn(trajectory) -> bool | list[int]",
    "rollout.group_filter": "fn(group) -> bool",
    "rollout.buffer_filter": "fn(trajectories) -> list[Trajectory]",
    "rollout.function": "async fn(ctx) -> list[Trajectory]",
}
NAMED = ("algo.advantage", "algo.loss", "algo.loss_agg")  # these also take a built-in name
HOOKS = {"on_run_start": "run", "after_rollout": "step, trajectories", "before_train_step": "step, batch",
         "after_train_step": "step, metrics", "after_weight_sync": "step, version", "on_checkpoint": "step, path",
         "on_run_end": "run, records"}


def is_path(value: Any) -> bool:
    return isinstance(value, str) and ":" in value


def import_path(key: str, path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise UserError(f"{key}={path}: not a dotted path; write module:attr (e.g. mypkg.rewards:score)")
    try:
        return resolve_attr(path)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{key}={path}: cannot load it ({type(e).__name__}: {e}); check the module path "
                        "and that its folder is on PYTHONPATH") from None


def check_call(key: str, path: str, fn: Any, signature: str) -> None:
    """``fn`` takes the call ``signature`` describes, else a one-line UserError."""
    names = [n.strip() for n in signature[signature.index("(") + 1:signature.index(")")].split(",")]
    args, kwargs = (names[:names.index("*")], names[names.index("*") + 1:]) if "*" in names else (names, [])
    try:
        if not callable(fn):
            raise TypeError(f"a {type(fn).__name__} is not callable")
        sig = inspect.signature(fn)
        sig.bind(*[a for a in args if a], **dict.fromkeys(kwargs))
    except ValueError:  # a builtin without a signature: trust it
        return
    except TypeError as e:
        raise UserError(f"{key}={path}: {getattr(fn, '__name__', fn)}{sig if callable(fn) else ''} does not fit "
                        f"({e}); expected {signature}") from None


@functools.cache
def load(key: str, path: str) -> Callable[..., Any]:
    fn = import_path(key, path)
    check_call(key, path, fn, KINDS[key])
    return fn


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def check_config(cfg: Any) -> None:
    """Every dotted-path key loads and takes its call (check_choices)."""
    for key in KINDS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if is_path(value) or (value and key not in NAMED):
            load(key, value)
    Hooks(cfg.run.hooks)
    for path in split_sinks(cfg.run.sinks)[1]:
        sink_class(path)
    if cfg.rollout.function and (cfg.rollout.mode != "sync" or cfg.rollout.group_filter):
        raise UserError("rollout.function replaces the scheduler's episodes: it needs rollout.mode=sync and no "
                        "rollout.group_filter (filter inside the function, or use rollout.buffer_filter)")


class Hooks:
    """``run.hooks=mod:obj[,...]``: objects (a class is built with no arguments) with `HOOKS` methods."""

    def __init__(self, text: str) -> None:
        self.objects: list[tuple[str, Any]] = []
        self.pending: dict[str, float] = {}  # metrics with no row yet: logged with the next hook's
        for path in [p.strip() for p in text.split(",") if p.strip()]:
            obj = import_path("run.hooks", path)
            obj = obj() if inspect.isclass(obj) else obj
            found = [h for h in HOOKS if callable(getattr(obj, h, None))]
            if not found:
                raise UserError(f"run.hooks={path}: has none of the hook methods; define one of {', '.join(HOOKS)}")
            for h in found:
                check_call("run.hooks", f"{path}.{h}", getattr(obj, h), f"{h}({HOOKS[h]})")
            self.objects.append((path, obj))

    async def fire(self, name: str, *args: Any) -> dict[str, float]:
        """Call hook ``name`` on every object; its metrics, with those still pending (on_checkpoint's)."""
        out = dict(self.pending)
        self.pending.clear()  # the same dict: `hooks.pending.update(await hooks.fire(...))` keeps working
        for path, obj in self.objects:
            got = await call(getattr(obj, name), *args) if hasattr(obj, name) else None
            if got is not None and not isinstance(got, dict):
                raise TypeError(f"run.hooks {path}.{name} returned {type(got).__name__}; return a dict of metrics or None")
            out.update({f"hooks/{k}": v for k, v in (got or {}).items()})
        return out


def split_sinks(text: str) -> tuple[str, list[str]]:
    """``run.sinks`` as (the built-in names, comma-joined; the ``module:Class`` sinks)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return ",".join(p for p in parts if not is_path(p)), [p for p in parts if is_path(p)]


def sink_class(path: str) -> Any:
    cls = import_path("run.sinks", path)
    check_call("run.sinks", path, cls, "Sink(*, run_dir, config, resume)")
    if not all(callable(getattr(cls, m, None)) for m in ("write", "close")):
        raise UserError(f"run.sinks={path}: needs write(record) and close() methods (docs/extensions.md)")
    return cls


def user_sinks(text: str, run_dir: Any, config: dict[str, Any], resume: bool) -> list[Any]:
    return [sink_class(p)(run_dir=run_dir, config=config, resume=resume) for p in split_sinks(text)[1]]


class _Wrapped:
    def __init__(self, inner: Any, task: Task | None, path: str) -> None:
        self._inner, self._task, self._path = inner, task, path

    def __getattr__(self, name: str) -> Any:  # all but open / score is the wrapped object's
        return getattr(self._inner, name)


class _ScoredSession(_Wrapped):
    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        """The env's score, then ``env.reward`` on the conversation and that score."""
        env_reward = await self._inner.score(messages)
        got = await call(load("env.reward", self._path), self._task, messages, env_reward)
        got = got if isinstance(got, Reward) else Reward(_numbers([got], 1, f"env.reward={self._path}")[0])
        return Reward(got.value, {**env_reward.parts, **got.parts, "env_reward": env_reward.value})


class RewardEnv(_Wrapped):
    """``env`` whose every episode is scored by ``env.reward`` (concurrently, before any group filter)."""

    async def open(self, task: Task, sandbox: Any = None) -> Any:
        return _ScoredSession(await self._inner.open(task, sandbox), task, self._path)


def with_reward(env: Any, path: str) -> Any:
    return RewardEnv(env, None, path) if path else env


def _numbers(values: list[Any], n: int, where: str) -> list[float]:
    if len(values) != n or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ValueError(f"{where} returned {values!r} for {n} trajectories; return one finite number each")
    return [float(v) for v in values]


async def batch_rewards(cfg: Any, trajs: list[Trajectory], tasks: dict[str, Task], tokenizer: Any) -> None:
    """``env.group_reward`` per group, then ``env.reward_post`` on the batch; rewrites ``reward`` in place."""
    scored = [t for t in trajs if t.status in (Status.COMPLETED, Status.TRUNCATED)]
    if path := cfg.env.group_reward:
        groups: dict[str, list[Trajectory]] = {}
        for t in scored:
            groups.setdefault(t.group_id, []).append(t)
        for members in groups.values():
            responses = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in members]
            got = await call(load("env.group_reward", path), tasks.get(members[0].task_id), responses, members)
            _assign(members, got, f"env.group_reward={path}")
    if path := cfg.env.reward_post:
        got = await call(load("env.reward_post", path), [float(t.reward or 0.0) for t in scored], scored)
        _assign(scored, got, f"env.reward_post={path}")


def _assign(trajs: list[Trajectory], rewards: Any, where: str) -> None:
    for t, v in zip(trajs, _numbers(list(rewards), len(trajs), where)):
        t.reward_parts.setdefault("env_reward", float(t.reward or 0.0))
        t.reward = float(v)


@dataclass
class RolloutContext:
    """What ``rollout.function`` gets for one step: the step's tasks, and the means to play them."""

    step: int
    tasks: list[Task]  # the sampler's next rollout.prompts_per_step tasks
    samples_per_prompt: int
    policy: Any  # the engine (a Policy): generate() with the current weights
    runner: Any  # EpisodeRunner: the env + harness (+ env.reward), as the scheduler plays them
    tokenizer: Any
    config: Any

    async def play(self, task: Task, group_id: str) -> list[Trajectory]:
        """One episode of ``task`` the standard way, in group ``group_id`` (normalized together)."""
        return await self.runner.run(task, self.policy, group_id)

    async def run(self, path: str) -> list[Trajectory]:
        trajs = await call(load("rollout.function", path), self)
        if not isinstance(trajs, list) or not trajs or not all(isinstance(t, Trajectory) for t in trajs):
            raise TypeError(f"rollout.function={path} returned {type(trajs).__name__}; return a non-empty list "
                            "of Trajectory (group_id set)")
        return trajs


def env_metrics(env: Any, trajs: list[Trajectory], prefix: str = "env") -> dict[str, float]:
    """An environment's own metrics of a batch (``batch_metrics``; envs/mix: per sub-environment)."""
    fn = getattr(env, "batch_metrics", None)
    return fn(trajs, prefix) if callable(fn) else {}
