"""OpenEnv side-car adapter (runs in the openenv venv; see sidecar.py for the protocol).

config: ``env_file`` + ``env_class``, ``action_class``, ``observation_class`` (an OpenEnv Environment and
its types), ``action_field`` (the text field the model's reply fills), ``observation_field`` (the text
shown to the model), ``num_tasks`` (task i = reset(seed=i)), ``mode`` ("inprocess": the Environment
object itself; "server": OpenEnv's own FastAPI server on 127.0.0.1, driven over its WebSocket client),
``max_steps``, ``max_tokens``. The episode reward is the sum of the step rewards OpenEnv returns.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

_server = {}  # mode=server: one OpenEnv server per side-car


def _load(config: dict):
    path = Path(config["env_file"])
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return (getattr(module, config["env_class"]), getattr(module, config["action_class"]),
            getattr(module, config["observation_class"]))


async def tasks(config: dict) -> list[dict]:
    return [{"id": str(i), "prompt": [], "info": {"seed": i}} for i in range(int(config.get("num_tasks", 4)))]


async def _server_url(config: dict) -> str:
    if "url" not in _server:
        import uvicorn
        from openenv.core.env_server import create_app

        env_cls, action_cls, obs_cls = _load(config)
        app = create_app(env_cls, action_cls, obs_cls, max_concurrent_envs=64)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        _server["task"] = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        _server["url"] = f"http://127.0.0.1:{port}"
    return _server["url"]


class _InProcess:
    def __init__(self, config: dict) -> None:
        env_cls, self.action_cls, _ = _load(config)
        self.env = env_cls()

    async def reset(self, seed: int) -> tuple[dict, float, bool]:
        obs = await self.env.reset_async(seed=seed)
        return obs.model_dump(), obs.reward or 0.0, obs.done

    async def step(self, action: dict) -> tuple[dict, float, bool]:
        obs = await self.env.step_async(self.action_cls(**action))
        return obs.model_dump(), obs.reward or 0.0, obs.done

    async def close(self) -> None:
        self.env.close()


class _OverServer:
    def __init__(self, url: str) -> None:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=url)

    async def reset(self, seed: int) -> tuple[dict, float, bool]:
        r = await self.client.reset(seed=seed)
        return r.observation, r.reward or 0.0, r.done

    async def step(self, action: dict) -> tuple[dict, float, bool]:
        r = await self.client.step(action)
        return r.observation, r.reward or 0.0, r.done

    async def close(self) -> None:
        await self.client.close()


async def episode(config: dict, task_id: str, base_url: str, api_key: str) -> dict:
    from openai import AsyncOpenAI

    env = _OverServer(await _server_url(config)) if config.get("mode") == "server" else _InProcess(config)
    text_in, text_out = config.get("observation_field", "message"), config.get("action_field", "message")
    llm = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    total, steps, done = 0.0, 0, False
    try:
        obs, _, done = await env.reset(int(task_id))
        messages = [{"role": "user", "content": str(obs.get(text_in, ""))}]
        while not done and steps < int(config.get("max_steps", 4)):
            reply = await llm.chat.completions.create(model="policy", messages=messages,
                                                      max_tokens=int(config.get("max_tokens", 32)))
            text = reply.choices[0].message.content or ""
            obs, reward, done = await env.step({text_out: text})
            total, steps = total + float(reward), steps + 1
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": str(obs.get(text_in, ""))}]
    finally:
        await env.close()
    return {"reward": total, "parts": {"steps": steps, "done": float(done)}, "info": {"mode": config.get("mode")}}
