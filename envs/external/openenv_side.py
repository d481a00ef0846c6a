"""OpenEnv side-car adapter (runs in the openenv venv; see sidecar.py for the protocol).

config (``env.options``, `adapters.OpenEnvOptions`): ``env`` (``package.module:EnvClass`` or
``path/to/file.py:EnvClass``), ``action`` / ``observation`` (same forms; default: the types the env's
``step`` and ``reset`` are annotated with, else the one Action / Observation its module imports), ``path`` (put on sys.path), ``action_field`` /
``observation_field`` (the text fields; default: the action's one str field, the observation's first),
``reset`` (one row of reset keywords per task; else ``num_tasks`` tasks with ``seed=i``), ``mode``
(``inprocess``: the Environment object; ``server``: OpenEnv's own FastAPI app on 127.0.0.1, driven
over its WebSocket client), ``max_steps``, ``max_tokens``.

As OpenEnv's server does: an env file inside a package is imported as that package's module (its
relative imports work); reset/step get only the keywords their signature takes; ``max_concurrent_envs``
is 1 unless the env declares ``SUPPORTS_CONCURRENT_SESSIONS`` (and episodes then run one at a time).
An MCP env (``MCPEnvironment``: actions are tool calls) is played in-process through its tools: the
model is offered them as OpenAI function tools, each call is a ``CallToolAction``. The reward is the sum of
the step rewards OpenEnv returns.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
import typing
from pathlib import Path

_state: dict = {}


def _import(spec: str, where: str):
    """``module:Attr`` or ``file.py:Attr``; a file inside a package is imported by its dotted name."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"{where} {spec!r} must be module:Class or path/to/file.py:Class")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{where}: no file {path}")
        root, parts = path.parent, [path.stem]
        while (root / "__init__.py").is_file():  # climb to the top of the package the file is in
            parts.insert(0, root.name)
            root = root.parent
        sys.path.insert(0, str(root))
        module_name = ".".join(parts)
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{where}: {module_name} has no {attr!r}") from None


def _hint(fn, name: str):
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the option
        return None
    tp = hints.get(name)
    return tp if isinstance(tp, type) else None


def _only(module, base):
    """The one subclass of ``base`` the env's module defines or imports (its models), else None."""
    found = {v for v in vars(module).values() if isinstance(v, type) and issubclass(v, base) and v is not base
             and v.__module__.split(".")[0] != "openenv"}
    return found.pop() if len(found) == 1 else None


def _classes(config: dict):
    if "classes" in _state:
        return _state["classes"]
    if config.get("path"):
        sys.path.insert(0, config["path"])
    spec = config.get("env") or (f"{config['env_file']}:{config['env_class']}" if config.get("env_file") else "")
    if not spec:
        raise ValueError("no OpenEnv environment named: set env.options.env=package.module:EnvClass")
    env_cls = _import(spec, "env.options.env")
    module = sys.modules[env_cls.__module__]

    def named(option: str, legacy: str, fallback):
        given = config.get(option) or config.get(legacy)
        if given:
            return _import(given, f"env.options.{option}") if ":" in given else getattr(module, given)
        return fallback

    from openenv.core.env_server import Action, Observation

    action_cls = named("action", "action_class", _hint(env_cls.step, "action") or _only(module, Action))
    obs_cls = named("observation", "observation_class", _hint(env_cls.reset, "return") or _only(module, Observation))
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    mcp = issubclass(env_cls, MCPEnvironment)
    if not mcp and (action_cls is None or obs_cls is None):
        raise ValueError(f"{env_cls.__name__}: its step/reset name no Action/Observation types; set "
                         "env.options.action and env.options.observation")
    _state["classes"] = env_cls, action_cls, obs_cls, mcp
    concurrent = bool(getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False))
    _state["gate"] = asyncio.Semaphore(64 if concurrent else 1)
    return _state["classes"]


def _text_field(model_cls, given: str, kind: str, one: bool) -> str:
    """The field the text goes in (action) or comes from (observation). An action whose one field is not
    text (a str enum, an int move) takes the reply too: pydantic validates it as OpenEnv's server would."""
    if given:
        return given
    skip = {"metadata", "done", "reward", "type"}
    own = {n: f for n, f in getattr(model_cls, "model_fields", {}).items() if n not in skip}
    fields = [n for n, f in own.items() if f.annotation in (str, str | None)
              or (isinstance(f.annotation, type) and issubclass(f.annotation, str))]
    if one and not fields:
        fields = [n for n, f in own.items() if f.is_required()]
    if fields and (len(fields) == 1 or not one):
        return fields[0]
    raise ValueError(f"{model_cls.__name__} has {'no' if not fields else 'several'} text fields {fields}; "
                     f"set env.options.{kind}_field")


def _reset_rows(config: dict) -> list[dict]:
    return [dict(r) for r in config.get("reset") or ()] or [{"seed": i} for i in range(int(config.get("num_tasks") or 4))]


async def tasks(config: dict) -> list[dict]:
    _classes(config)  # a wrong env name fails the listing, not the first episode
    return [{"id": str(i), "prompt": [], "info": {"reset": row}} for i, row in enumerate(_reset_rows(config))]


def _accepted(fn, kwargs: dict) -> dict:
    """The keywords ``fn`` takes (OpenEnv's server: http_server ``_get_valid_kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


async def _server_url(config: dict) -> str:
    if "url" not in _state:
        import uvicorn
        from openenv.core.env_server import create_app

        env_cls, action_cls, obs_cls, _ = _classes(config)
        concurrent = bool(getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False))
        app = create_app(env_cls, action_cls, obs_cls, max_concurrent_envs=64 if concurrent else 1)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        _state["task"] = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        _state["url"] = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    return _state["url"]


class _InProcess:
    def __init__(self, config: dict) -> None:
        from openenv.core.env_server import Environment

        env_cls, self.action_cls, _, _ = _classes(config)
        self.env, self.base = env_cls(), Environment

    async def _call(self, name: str, *args, **kwargs):
        is_async = getattr(type(self.env), f"{name}_async") is not getattr(self.base, f"{name}_async")
        fn = getattr(self.env, f"{name}_async" if is_async else name)
        kwargs = _accepted(fn, kwargs)
        obs = await fn(*args, **kwargs) if is_async else await asyncio.to_thread(fn, *args, **kwargs)
        return obs.model_dump(), obs.reward or 0.0, obs.done

    async def reset(self, kwargs: dict):
        return await self._call("reset", **kwargs)

    async def step(self, action: dict):
        return await self._call("step", self.action_cls(**action))

    async def close(self) -> None:
        self.env.close()


class _OverServer:
    def __init__(self, url: str) -> None:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=url)

    async def reset(self, kwargs: dict):
        r = await self.client.reset(**kwargs)
        return r.observation, r.reward or 0.0, r.done

    async def step(self, action: dict):
        r = await self.client.step(action)
        return r.observation, r.reward or 0.0, r.done

    async def close(self) -> None:
        await self.client.close()


def _as_text(value) -> str:
    if isinstance(value, str):
        return value
    content = getattr(value, "content", None) or (value.get("content") if isinstance(value, dict) else None)
    if isinstance(content, list):  # an MCP CallToolResult: its text parts
        return "".join(getattr(c, "text", None) or (c.get("text", "") if isinstance(c, dict) else "") for c in content)
    return json.dumps(value, default=str)


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    from openai import AsyncOpenAI

    _, action_cls, obs_cls, mcp = _classes(config)
    row = _reset_rows(config)[int(task_id)]
    llm = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    extra = {"max_tokens": int(config["max_tokens"])} if config.get("max_tokens") else {}
    if mcp and config.get("mode") == "server":
        raise ValueError("an MCP environment is played in-process here (mode=inprocess); mode=server drives "
                         "text-action environments only")
    async with _state["gate"]:  # a non-concurrent env plays one episode at a time
        env = _OverServer(await _server_url(config)) if config.get("mode") == "server" else _InProcess(config)
        try:
            play = _play_tools if mcp else _play_text
            total, steps, done = await play(config, env, llm, extra, row, action_cls, obs_cls)
        finally:
            await env.close()
    return {"reward": total, "parts": {"steps": steps, "done": float(done)}, "info": {"mode": config.get("mode")}}


def _shown(obs: dict, field: str) -> str:
    """What the model sees of an observation: its text field, else its fields as JSON (a board, a grid)."""
    if field:
        return str(obs.get(field, ""))
    return json.dumps({k: v for k, v in obs.items() if k not in ("done", "reward", "metadata")}, default=str)


async def _play_text(config, env, llm, extra, row, action_cls, obs_cls):
    try:
        text_in = _text_field(obs_cls, config.get("observation_field", ""), "observation", one=False)
    except ValueError:
        text_in = ""  # no text field: the observation is shown as JSON
    text_out = _text_field(action_cls, config.get("action_field", ""), "action", one=True)
    field = getattr(action_cls, "model_fields", {}).get(text_out)
    as_text = field is None or field.annotation in (str, str | None)  # a str gets the reply verbatim; a move, stripped
    total, steps = 0.0, 0
    obs, _, done = await env.reset(row)
    messages = [{"role": "user", "content": _shown(obs, text_in)}]
    while not done and steps < int(config.get("max_steps", 4)):
        reply = await llm.chat.completions.create(model="policy", messages=messages, **extra)
        text = reply.choices[0].message.content or ""  # sent back as generated: one history at the proxy
        obs, reward, done = await env.step({text_out: text if as_text else text.strip()})
        total, steps = total + float(reward), steps + 1
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": _shown(obs, text_in)}]
    return total, steps, done


async def _play_tools(config, env, llm, extra, row, action_cls, obs_cls):
    """An MCP env: list its tools, offer them to the model, run each call as a CallToolAction."""
    obs, _, done = await env.reset(row)
    listed, _, _ = await env._call("step", _mcp_action("ListToolsAction"))
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                "parameters": t.get("input_schema") or {"type": "object"}}}
             for t in listed.get("tools", [])]
    if not tools:
        raise ValueError("this MCP environment lists no tools; nothing for the model to call")
    shown = {k: v for k, v in obs.items() if k not in ("done", "reward", "metadata") and v not in (None, "", [], {})}
    prompt = obs.get(config.get("observation_field") or "") or (json.dumps(shown, default=str) if shown else
                                                                 "Use the tools to solve the task.")
    messages = [{"role": "user", "content": str(prompt)}]
    total, steps = 0.0, 0
    while not done and steps < int(config.get("max_steps", 4)):
        reply = await llm.chat.completions.create(model="policy", messages=messages, tools=tools, **extra)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            out, reward, done = await env._call("step", _mcp_action("CallToolAction", tool_name=call.function.name,
                                                                    arguments=args))
            total, steps = total + float(reward), steps + 1
            result = out.get("error") or out.get("result")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _as_text(result)})
    return total, steps, done


def _mcp_action(name: str, **fields):
    from openenv.core.env_server import mcp_types

    return getattr(mcp_types, name)(**fields)
