"""HUD side-car adapter (runs in the hud venv; see sidecar.py for the protocol).

config: ``env_file`` (a .py file or folder declaring a ``hud.Environment``), ``env_name`` (which one,
when it declares several), ``tasks`` (rows ``{"template": id, "args": {...}}``; task i = row i),
``max_steps`` (the agent's step budget), ``max_tokens``.

An episode is HUD's own: ``hud.eval.Task(env, template, args).run(agent, runtime=LocalRuntime(env_file))``
serves the environment locally over HUD's control channel, and the agent is HUD's OpenAI-compatible
``OpenAIChatAgent`` with its client pointed at our proxy. The reward is HUD's grade of the run (the
template's second yield). Nothing reaches the HUD platform: with telemetry off and no HUD_API_KEY its
job/trace reporting is a no-op (hud/eval/job.py ``_reporting_enabled``).
"""

from __future__ import annotations

import os

# Before hud is imported: hud.settings reads these once. No platform reporting, no gateway key.
os.environ["HUD_TELEMETRY_ENABLED"] = "false"
os.environ.pop("HUD_API_KEY", None)


def _env_name(config: dict) -> str:
    if config.get("env_name"):
        return config["env_name"]
    from hud.environment import load_environment

    return load_environment(config["env_file"]).name


async def tasks(config: dict) -> list[dict]:
    return [{"id": str(i), "prompt": [], "info": {"template": row["template"], "args": row.get("args", {})}}
            for i, row in enumerate(config["tasks"])]


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    from hud.agents.openai_compatible import OpenAIChatAgent
    from hud.agents.types import OpenAIChatConfig
    from hud.eval import LocalRuntime, Task
    from openai import AsyncOpenAI

    row = config["tasks"][int(task_id)]
    task = Task(env=_env_name(config), id=row["template"], args=row.get("args", {}))
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)  # the proxy never needs a retry
    agent = OpenAIChatAgent(OpenAIChatConfig(
        model="policy", model_client=client, max_steps=int(config.get("max_steps", 4)),
        completion_kwargs={"max_tokens": int(config.get("max_tokens", 32))}))
    job = await task.run(agent, runtime=LocalRuntime(config["env_file"], env=config.get("env_name")))
    (run,) = job.runs
    errors = [s.error for s in run.trace.steps if getattr(s, "error", None)]
    if run.trace.status == "error" or run.grade.is_error:
        raise RuntimeError(f"HUD run {run.trace.status}: {'; '.join(map(str, errors)) or run.grade.content}")
    return {"reward": float(run.reward), "parts": {"steps": float(_model_steps(run))},
            "info": {"status": run.trace.status, "answer": run.trace.content, "template": row["template"]}}


def _model_steps(run) -> int:
    return sum(1 for s in run.trace.steps if getattr(s, "source", None) == "agent")
