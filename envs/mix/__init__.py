"""Several environments in one run: ``env.mix=arith-tools:0.7,dataset:0.3``.

Each sub-environment is built the way ``env.name`` alone would build it (``miles_agent.build.build_env``),
with its own options from ``env.options.<name>.<key>`` (``env.options.dataset.path=data.jsonl``). Its
tasks keep their ids under a ``<name>/`` prefix, and the run's metrics carry ``env/<name>/reward_mean``,
``pass_rate`` and ``episodes`` (the loop asks `MixEnv.batch_metrics`). Weights are sampling shares: the train
split holds ``round(weight / sum * size)`` tasks of each environment (cycled when it has fewer), where
``size`` is the total of the sub-environments' train splits, shuffled each epoch by the task sampler.
Eval splits are the sub-environments' whole eval splits. All sub-environments share one harness.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_agent import registry
from miles_agent.environment import Environment, EnvSession, Task
from miles_agent.errors import UserError
from miles_agent.sandbox import Sandbox, SandboxSpec
from miles_agent.types import Status, Trajectory

SEP = "/"


def parse_mix(text: str) -> list[tuple[str, float]]:
    out = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, _, weight = part.rpartition(":")
        if not name:
            name, weight = weight, "1"
        try:
            w = float(weight)
        except ValueError:
            raise UserError(f"env.mix: {part!r} is not name:weight "
                            "(e.g. env.mix=arith-tools:0.7,dataset:0.3)") from None
        if not w > 0:
            raise UserError(f"env.mix: the weight of {name!r} must be > 0 (got {weight})")
        out.append((name, w))
    names = [n for n, _ in out]
    if len(out) < 1 or len(set(names)) != len(names):
        raise UserError(f"env.mix={text!r}: name each environment once, e.g. env.mix=arith-tools:0.7,dataset:0.3")
    if "mix" in names:
        raise UserError("env.mix cannot contain mix itself")
    return out


def sub_config(cfg: Any, name: str) -> Any:
    """The run's config as if ``env.name=<name>`` with ``env.options.<name>`` as its options."""
    options = cfg.env.options
    unknown = [k for k in options if k not in dict(parse_mix(cfg.env.mix))]
    if unknown:
        raise UserError(f"env.options.{unknown[0]}: with env.mix, env.options holds one mapping per environment "
                        f"of the mix ({cfg.env.mix}); write env.options.<name>.<key>=value")
    own = options.get(name, {})
    if not isinstance(own, dict):
        raise UserError(f"env.options.{name} must be a mapping of that environment's options")
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, name=name, mix="", options=own))


class MixEnv(Environment):
    name = "mix"
    description = "Several environments in one run, by sampling weight (env.mix=a:0.7,b:0.3)."
    default_harness = "chat-tools"

    def __init__(self, envs: dict[str, Environment], weights: dict[str, float]) -> None:
        self.envs, self.weights = envs, weights
        self.needs_sandbox = any(e.needs_sandbox for e in envs.values())
        self._train: list[Task] | None = None

    @classmethod
    def check(cls, cfg: Any) -> Any:
        """Every sub-environment's choices and options checked (build.check_choices); returns the config
        the core goes on checking (env.name=mix, with no options of its own)."""
        from miles_agent.build import check_choices, harness_name

        harnesses = set()
        for name, _ in parse_mix(cfg.env.mix):
            sub, cls = sub_config(cfg, name), registry.load("envs", name, key="env.mix")
            check_choices(sub)
            harnesses.add(harness_name(sub, cls))
        if len(harnesses) > 1:
            raise UserError(f"env.mix: the environments use different harnesses ({', '.join(sorted(harnesses))}); "
                            "mix environments that share one, or set env.harness")
        return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, name="mix", mix="", options={}))

    @classmethod
    def from_config(cls, cfg: Any) -> MixEnv:
        from miles_agent.build import build_env, harness_name

        mix = parse_mix(cfg.env.mix)
        env = cls({n: build_env(sub_config(cfg, n)) for n, _ in mix}, dict(mix))
        env.default_harness = harness_name(sub_config(cfg, mix[0][0]), env.envs[mix[0][0]])
        return env

    def env_of(self, task_id: str) -> str:
        return task_id.partition(SEP)[0]

    def batch_metrics(self, trajs: list[Trajectory], prefix: str = "env") -> dict[str, float]:
        """Per sub-environment: episodes, reward mean and pass rate (scored episodes with reward >= 1)."""
        by: dict[str, list[float]] = {}
        for t in trajs:
            if t.status in (Status.COMPLETED, Status.TRUNCATED) and t.reward is not None:
                by.setdefault(self.env_of(t.task_id), []).append(float(t.reward))
        out = {}
        for name, rewards in sorted(by.items()):
            out[f"{prefix}/{name}/episodes"] = float(len(rewards))
            out[f"{prefix}/{name}/reward_mean"] = sum(rewards) / len(rewards)
            out[f"{prefix}/{name}/pass_rate"] = sum(r >= 1.0 for r in rewards) / len(rewards)
        return out

    def _split(self, task: Task) -> tuple[Environment, Task]:
        name, _, inner = task.id.partition(SEP)
        return self.envs[name], dataclasses.replace(task, id=inner)

    def tasks(self, split: str = "train") -> list[Task]:
        if split == "train" and self._train is not None:
            return self._train
        per = {n: [dataclasses.replace(t, id=f"{n}{SEP}{t.id}") for t in e.tasks(split)] for n, e in self.envs.items()}
        if split != "train":
            return [t for ts in per.values() for t in ts]
        size, total = sum(len(ts) for ts in per.values()), sum(self.weights.values())
        out = []
        for name, ts in per.items():
            if not ts:
                raise UserError(f"env.mix: environment {name!r} has no train tasks")
            k = max(1, round(self.weights[name] / total * size))
            out += [ts[i % len(ts)] for i in range(k)]
        # Cycled copies share an id; the sampler and the group ids need each position's own.
        seen: dict[str, int] = {}
        for i, t in enumerate(out):
            n = seen[t.id] = seen.get(t.id, -1) + 1
            if n:
                out[i] = dataclasses.replace(t, id=f"{t.id}#{n}")
        self._train = out
        return out

    def _inner(self, task: Task) -> tuple[Environment, Task]:
        env, inner = self._split(task)
        return env, dataclasses.replace(inner, id=inner.id.partition("#")[0])

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        env, inner = self._inner(task)
        return env.sandbox_spec(inner)

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        env, inner = self._inner(task)
        return await env.open(inner, sandbox)
