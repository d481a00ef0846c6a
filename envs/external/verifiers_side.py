"""Verifiers side-car adapter (runs in the verifiers 0.4 venv; see sidecar.py for the protocol).

config (``env.options``, `adapters.VerifiersOptions`): ``id`` (a verifiers.v1 taskset id importable in
the venv; ``path`` is put on sys.path first), ``env_id`` (an Env to pair with it), ``args`` (the
taskset's settings), ``env_args`` (env-level settings and roles), ``harness``, ``runtime``, ``num_tasks``.

The env is built as verifiers' own CLI builds it: ``resolve_env_config`` narrows the raw config to the
env's own config class (``Env[YourConfig]``: a two-player env's roles, its knobs) and
``load_environment`` constructs it. An episode is ``Env.run_slot``: its harness programs talk to its
interception server, which relays to our proxy, and its reward functions score each trace. Every trace
(one per player) comes back with its rewards and metrics; `harnesses/external.py` maps each onto the
proxy trajectory of that player. The runtime defaults to ``subprocess`` (verifiers' default is Prime's
hosted sandboxes) and is an option; the client points at the proxy.
"""

from __future__ import annotations

import itertools
import os
import sys
import uuid

INFINITE_TASKS = 64  # tasks listed from an INFINITE taskset unless num_tasks says otherwise
_env: dict = {}


def _raw_config(config: dict, role_fields: list[str]) -> dict:
    raw = dict(config.get("env_args") or {})
    if config.get("env_id"):
        raw["id"] = config["env_id"]
    raw["taskset"] = {**(raw.get("taskset") or {}), **(config.get("args") or {}), "id": config["id"]}
    for role in role_fields:  # every seat gets the runtime (and the harness, when one is named)
        seat = dict(raw.get(role) or {})
        seat.setdefault("runtime", {"type": config.get("runtime") or "subprocess"})
        harness = "null" if "harness" in config and config["harness"] is None else config.get("harness")
        if harness:  # None: `env.options.harness=null`, which YAML reads as None, is verifiers' null harness
            seat.setdefault("harness", {"id": harness})
        raw[role] = seat
    return raw


def _environment(config: dict):
    if "env" not in _env:
        if not config.get("id"):
            raise ValueError("no taskset named: set env.options.id=<taskset id>")
        if config.get("path"):
            sys.path.insert(0, config["path"])
            # and for the processes verifiers starts (a taskset's tool servers run `python -m <taskset>...`)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [config["path"], os.environ.get("PYTHONPATH")]))
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.utils.loaders import env_config_type, load_environment, resolve_env_config

        cls = env_config_type(config["id"], config.get("env_id") or "")
        roles = [n for n, f in cls.model_fields.items() if isinstance(f.default, AgentConfig)]
        _env["env"] = env = load_environment(resolve_env_config(_raw_config(config, roles)))
        taskset = env.taskset
        bounded = getattr(taskset, "bounded", not taskset.INFINITE)
        n = int(config.get("num_tasks") or 0) or (None if bounded else INFINITE_TASKS)
        rows = list(itertools.islice(iter(taskset), n))  # lazy: an INFINITE taskset's load() never ends
        _env["tasks"] = {}
        for i, t in enumerate(rows):
            _env["tasks"].setdefault(_task_id(t, i), t)
    return _env["env"], _env["tasks"]


def _task_id(task, i: int) -> str:
    for key in (task.data.id, getattr(task.data, "name", None), task.data.idx):
        if key is not None:
            return str(key)
    return str(i)


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(getattr(m, "content", ""))
                     for m in prompt)


async def tasks(config: dict) -> list[dict]:
    _, rows = _environment(config)
    return [{"id": tid, "prompt": [], "info": {"prompt": _prompt_text(t.data.prompt)}} for tid, t in rows.items()]


def _number(v) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _trace(trace) -> dict:
    rewards = {k: r.value for k, r in trace.rewards.items() if r is not None}
    metrics = {k: v for k, v in trace.metrics.items() if _number(v) is not None}
    first = next((m for m in trace.messages), None)
    content = first.get("content") if isinstance(first, dict) else getattr(first, "content", "")
    return {"name": trace.agent.name, "reward": float(trace.reward), "parts": {**metrics, **rewards},
            "first": content if isinstance(content, str) else "", "reply": trace.last_reply or "",
            "errors": [str(e) for e in trace.errors]}


async def _play(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
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
    traces = [_trace(t) for t in ep.traces]
    names = [t["name"] for t in traces]
    for i, t in enumerate(traces):  # several runs of one seat (attempts): named apart
        if names.count(t["name"]) > 1:
            t["name"] = f"{t['name']}#{names[:i].count(t['name'])}"
    if all(t["errors"] and not t["parts"] for t in traces):
        raise RuntimeError(f"verifiers trace failed: {traces[0]['errors']}")
    # One trace: its reward and parts. Several (players): the first seat's reward is the episode's, each
    # seat's rewards and metrics are parts under its name, and `traces` lets the harness give each
    # player's trajectory its own reward.
    head = traces[0]
    parts = head["parts"] if len(traces) == 1 else {
        f"{t['name']}/{k}": v for t in traces for k, v in {"reward": t["reward"], **t["parts"]}.items()}
    return {"reward": head["reward"], "parts": parts, "traces": traces if len(traces) > 1 else [],
            "info": {"reply": ep.traces[0].last_reply, "errors": [e for t in traces for e in t["errors"]]}}


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    return await _play(config, task_id, base_url, api_key)


async def oracle(config: dict, task_id: str) -> dict:
    """The task's reference answer (``task.data.answer``) as the model's every reply, from a scripted
    OpenAI-compatible endpoint in this process: verifiers' own harness and reward functions score it."""
    from scripted_model import ScriptedModel

    _, rows = _environment(config)
    answer = getattr(rows[task_id].data, "answer", None)
    if answer is None:
        raise ValueError(f"taskset {config['id']!r} gives its tasks no reference answer (task.data.answer)")
    async with ScriptedModel(lambda messages: str(answer)) as model:
        return await _play(config, task_id, model.base_url, "oracle")
