"""Verifiers side-car adapter (runs in the verifiers 0.4 venv; see sidecar.py for the protocol).

config: ``taskset`` (a verifiers.v1 taskset id, importable in the venv; ``taskset_path`` is put on
sys.path first), ``harness`` (a verifiers harness id, default ``null``: verifiers' own chat program),
``num_tasks``. The episode is verifiers' own: ``Env.run_slot`` with its harness in the subprocess
runtime, its interception server relaying model calls to our proxy, and its reward functions. Nothing
hosted: the runtime is ``subprocess`` (the default is Prime's hosted sandboxes) and the client points at
the proxy (the default is Prime's inference service).
"""

from __future__ import annotations

import os
import sys
import uuid

_env = {}


def _environment(config: dict):
    if "env" not in _env:
        if config.get("taskset_path"):
            sys.path.insert(0, config["taskset_path"])
        from verifiers.v1.envs.single_agent import SingleAgentEnvConfig
        from verifiers.v1.utils.loaders import load_environment

        cfg = SingleAgentEnvConfig.model_validate({
            "taskset": {"id": config["taskset"]},
            "agent": {"harness": {"id": config.get("harness", "null")}, "runtime": {"type": "subprocess"}},
        })
        _env["env"] = load_environment(cfg)
        _env["tasks"] = {_task_id(t): t for t in list(_env["env"].taskset)[: int(config.get("num_tasks", 1000))]}
    return _env["env"], _env["tasks"]


def _task_id(task) -> str:
    return str(task.data.id if task.data.id is not None else task.data.idx)


async def tasks(config: dict) -> list[dict]:
    _, rows = _environment(config)
    return [{"id": tid, "prompt": [], "info": {"prompt": t.data.prompt_text}} for tid, t in rows.items()]


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    from verifiers.v1.clients import EvalClientConfig, ModelContext
    from verifiers.v1.env import RunSlot

    env, rows = _environment(config)
    key_var = f"MILES_PROXY_KEY_{uuid.uuid4().hex}"  # one variable per episode: concurrent keys differ
    os.environ[key_var] = api_key
    try:
        ctx = ModelContext(client=EvalClientConfig(base_url=base_url, api_key_var=key_var), model="policy")
        async with env.serving():
            ep = await env.run_slot(RunSlot(rows[task_id]), ctx)
    finally:
        os.environ.pop(key_var, None)
    if ep.errors or not ep.traces:
        raise RuntimeError(f"verifiers episode failed: {[str(e) for e in ep.errors] or 'no trace'}")
    trace = ep.traces[0]
    errors = [str(e) for e in trace.errors]
    if errors and not trace.rewards:
        raise RuntimeError(f"verifiers trace failed: {errors}")
    return {"reward": float(trace.reward), "parts": {k: r.value for k, r in trace.rewards.items() if r is not None},
            "info": {"reply": trace.last_reply, "errors": errors}}
