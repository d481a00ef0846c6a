"""Where the loop runs user code (plugins.py loads it): rewards, the rollout function, per-env metrics.

* ``env.reward``: the episode's env session is wrapped, so the user function scores the finished
  conversation right where the env would (concurrently, before any group filter sees the reward);
* ``env.group_reward`` and ``env.reward_post``: on the batch, after rollout and before advantages;
* ``rollout.function``: replaces the scheduler's episode generation for a step (sync mode);
* per-environment metrics when the environment names each task's sub-environment (``env_of``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from miles_agent import plugins
from miles_agent.environment import Reward, Task
from miles_agent.types import Status, Trajectory


def as_reward(got: Any, path: str) -> Reward:
    if isinstance(got, Reward):
        return got
    if isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got):
        return Reward(float(got))
    raise TypeError(f"env.reward={path} returned {got!r}; return a finite number or a Reward")


class _ScoredSession:
    """An env session whose ``score`` ends with the user's reward function."""

    def __init__(self, session: Any, task: Task, path: str) -> None:
        self._session, self._task, self._path = session, task, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        env_reward = await self._session.score(messages)
        got = as_reward(await plugins.call(plugins.load("env.reward", self._path), self._task, messages,
                                           env_reward), self._path)
        return Reward(got.value, {**env_reward.parts, **got.parts, "env_reward": env_reward.value})


class RewardEnv:
    """``env`` with ``env.reward`` applied to every episode it opens; everything else is ``env``'s."""

    def __init__(self, env: Any, path: str) -> None:
        self._env, self._path = env, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def open(self, task: Task, sandbox: Any = None) -> Any:
        return _ScoredSession(await self._env.open(task, sandbox), task, self._path)


def with_reward(env: Any, path: str) -> Any:
    return RewardEnv(env, path) if path else env


async def batch_rewards(cfg: Any, trajs: list[Trajectory], tasks: dict[str, Task], tokenizer: Any) -> dict[str, float]:
    """``env.group_reward`` per group, then ``env.reward_post`` on the batch; rewrites ``reward`` in place."""
    scored = [t for t in trajs if t.status in (Status.COMPLETED, Status.TRUNCATED)]
    if cfg.env.group_reward:
        fn = plugins.load("env.group_reward", cfg.env.group_reward)
        groups: dict[str, list[Trajectory]] = {}
        for t in scored:
            groups.setdefault(t.group_id, []).append(t)
        for members in groups.values():
            responses = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in members]
            got = await plugins.call(fn, tasks.get(members[0].task_id), responses, members)
            _assign(members, got, f"env.group_reward={cfg.env.group_reward}")
    if cfg.env.reward_post:
        got = await plugins.call(plugins.load("env.reward_post", cfg.env.reward_post),
                                 [float(t.reward or 0.0) for t in scored], scored)
        _assign(scored, got, f"env.reward_post={cfg.env.reward_post}")
    return {}


def _assign(trajs: list[Trajectory], rewards: Any, where: str) -> None:
    values = list(rewards)
    if len(values) != len(trajs) or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ValueError(f"{where} returned {values!r} for {len(trajs)} trajectories; return one finite number each")
    for t, v in zip(trajs, values):
        t.reward_parts.setdefault("env_reward", float(t.reward or 0.0))
        t.reward = float(v)


@dataclass
class RolloutContext:
    """What ``rollout.function`` gets for one step: the step's tasks, and the means to play them."""

    step: int
    tasks: list[Task]
    samples_per_prompt: int
    policy: Any  # the engine (a Policy): generate() with the current weights
    runner: Any  # EpisodeRunner: the env + harness, as the scheduler plays them
    tokenizer: Any
    config: Any

    async def play(self, task: Task, group_id: str) -> list[Trajectory]:
        """One episode of ``task`` the standard way (harness, env, reward), in group ``group_id``."""
        return await self.runner.run(task, self.policy, group_id)


async def run_rollout_function(path: str, ctx: RolloutContext) -> list[Trajectory]:
    trajs = await plugins.call(plugins.load("rollout.function", path), ctx)
    if not isinstance(trajs, list) or not all(isinstance(t, Trajectory) for t in trajs) or not trajs:
        raise TypeError(f"rollout.function={path} returned {type(trajs).__name__}; return a non-empty list of "
                        "Trajectory (group_id set: samples sharing it are normalized together)")
    return trajs


def env_metrics(env: Any, trajs: list[Trajectory], prefix: str = "env") -> dict[str, float]:
    """Per sub-environment (an env with ``env_of(task_id)``): episodes, reward mean and pass rate
    (the share of scored episodes with reward >= 1)."""
    env_of = getattr(env, "env_of", None)
    if env_of is None:
        return {}
    by: dict[str, list[float]] = {}
    for t in trajs:
        if t.status in (Status.COMPLETED, Status.TRUNCATED) and t.reward is not None:
            by.setdefault(env_of(t.task_id), []).append(float(t.reward))
    out = {}
    for name, rewards in sorted(by.items()):
        out[f"{prefix}/{name}/episodes"] = float(len(rewards))
        out[f"{prefix}/{name}/reward_mean"] = sum(rewards) / len(rewards)
        out[f"{prefix}/{name}/pass_rate"] = sum(r >= 1.0 for r in rewards) / len(rewards)
    return out
