"""HUD side-car adapter (runs in the hud venv; see sidecar.py for the protocol).

config (``env.options``, `adapters.HudOptions`): ``env_file`` (a .py file or folder declaring a
``hud.Environment``), ``env_name`` (which one, when it declares several), ``taskset`` (the env's own
taskset: a .py / folder / .json / .jsonl that ``hud.eval.Taskset.from_file`` loads; default: the tasks
declared in ``env_file``; ``file.py:function`` for one built in code), or ``tasks`` (rows ``{"template": id,
"args": {...}}``), ``runtime``
(``local``: HUD's LocalRuntime in the side-car; ``subprocess``: HUD's child-process server),
``max_steps``, ``max_tokens``.

An episode is HUD's own: ``Task.run(agent, runtime=...)`` serves the environment over HUD's control
channel, and the agent is HUD's OpenAI-compatible ``OpenAIChatAgent`` with its client pointed at our
proxy. The reward is HUD's grade of the run; the grade's ``info`` (``EvaluationResult.info``) and its
subscores come back too (numbers as parts). Nothing reaches the HUD platform: with telemetry off and
no HUD_API_KEY its job/trace reporting is a no-op (hud/eval/job.py ``_reporting_enabled``).
"""

from __future__ import annotations

import os

# Before hud is imported: hud.settings reads these once. No platform reporting, no gateway key.
os.environ["HUD_TELEMETRY_ENABLED"] = "false"
os.environ.pop("HUD_API_KEY", None)

_cache: dict = {}


def _env_name(config: dict) -> str:
    if config.get("env_name"):
        return config["env_name"]
    from hud.environment import load_environment

    return load_environment(config["env_file"]).name


def _tasks(config: dict) -> list:
    """HUD Task objects: the given rows, else the env's own taskset (HUD's loader)."""
    if "tasks" not in _cache:
        from hud.eval import Task

        if not config.get("env_file"):
            raise ValueError("no HUD environment named: set env.options.env_file=path/to/env.py")
        if config.get("tasks"):
            name = _env_name(config)
            found = [Task(env=name, id=r["template"], args=r.get("args", {})) for r in config["tasks"]]
        else:
            found = _load_taskset(config.get("taskset") or config["env_file"])
            if not found:
                raise ValueError(f"{config.get('taskset') or config['env_file']} declares no HUD tasks; give "
                                 "env.options.taskset=FILE (.py/.json/.jsonl) or env.options.tasks rows")
        _cache["tasks"] = found
    return _cache["tasks"]


def _load_taskset(source: str) -> list:
    """HUD's own loader (``Taskset.from_file``: module-level tasks of a .py or folder, or .json/.jsonl rows),
    or ``file.py:function`` for a taskset an env builds in code (a function returning a Taskset, a list
    of Tasks, or a (Taskset, runtime) pair, as HUD's cookbooks write them)."""
    import importlib.util
    import sys
    from pathlib import Path

    from hud.eval.taskset import Taskset

    if ".py:" not in source:
        return list(Taskset.from_file(source))
    path, attr = source.rsplit(":", 1)
    file = Path(path).resolve()
    sys.path.insert(0, str(file.parent))  # its sibling imports (the env module) resolve
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = getattr(module, attr)
    made = made() if callable(made) and not isinstance(made, Taskset) else made
    if isinstance(made, tuple):  # (taskset, runtime)
        made = made[0]
    return list(made)


async def tasks(config: dict) -> list[dict]:
    return [{"id": str(i), "prompt": [], "info": {"template": t.id, "args": t.args}}
            for i, t in enumerate(_tasks(config))]


def _runtime(config: dict):
    from hud.eval import LocalRuntime

    kind = config.get("runtime") or "local"
    if kind == "local":
        return LocalRuntime(config["env_file"], env=config.get("env_name") or None)
    if kind == "subprocess":
        from hud.eval.runtime import SubprocessRuntime

        return SubprocessRuntime(config["env_file"], env=config.get("env_name") or None)
    raise ValueError(f"runtime {kind!r} is not supported here (local, subprocess); HUD's docker/modal/hosted "
                     "runtimes need images or the HUD platform")


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    from hud.agents.openai_compatible import OpenAIChatAgent
    from hud.agents.types import OpenAIChatConfig
    from openai import AsyncOpenAI

    task = _tasks(config)[int(task_id)]
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)  # the proxy never needs a retry
    extra = {"max_tokens": int(config["max_tokens"])} if config.get("max_tokens") else {}
    agent = OpenAIChatAgent(OpenAIChatConfig(model="policy", model_client=client,
                                             max_steps=int(config.get("max_steps", 4)), completion_kwargs=extra))
    job = await task.run(agent, runtime=_runtime(config))
    (run,) = job.runs
    errors = [s.error for s in run.trace.steps if getattr(s, "error", None)]
    if run.trace.status == "error" or run.grade.is_error:
        raise RuntimeError(f"HUD run {run.trace.status}: {'; '.join(map(str, errors)) or run.grade.content}")
    subscores = {f"subscore/{s.get('name')}": float(s["value"]) for s in run.grade.raw.get("subscores") or ()
                 if isinstance(s, dict) and _number(s.get("value"))}
    info_parts = {f"info/{k}": float(v) for k, v in run.grade.info.items() if _number(v)}
    return {"reward": float(run.reward), "parts": {"steps": float(_model_steps(run)), **subscores, **info_parts},
            "info": {"status": run.trace.status, "answer": run.trace.content, "template": task.id,
                     "grade_info": run.grade.info, "grade": run.grade.content}}


def _model_steps(run) -> int:
    return sum(1 for s in run.trace.steps if getattr(s, "source", None) == "agent")
