"""NeMo Gym adapter: a NeMo Gym resources server, driven over its HTTP contract.

nemo-gym itself needs Python >= 3.13.14 and is not installed here, so this adapter speaks the
resources-server contract directly (aiohttp) instead of running the package in a side-car. The
contract, as read from NVIDIA-NeMo/Gym:

- ``nemo_gym/base_resources_server.py``: ``SimpleResourcesServer`` serves ``POST /seed_session``
  (``BaseSeedSessionRequest``) and ``POST /verify`` (``BaseVerifyRequest`` = ``responses_create_params``
  + ``response``, a ``NeMoGymResponse``; answered by ``BaseVerifyResponse`` = the request + ``reward``;
  ``BaseMultiRewardVerifyResponse`` adds ``reward_components``); a server adds one ``POST /<tool_name>``
  route per tool (``resources_servers/example_session_state_mgmt/app.py``).
- ``nemo_gym/server_utils.py`` (``setup_session_middleware``): the session is a signed cookie that
  Starlette's SessionMiddleware sets on the first answer; every later call must send it back.
- ``responses_api_agents/simple_agent/app.py`` (``SimpleAgent.run`` / ``_create_episode``): the agent
  posts the whole dataset row to ``/seed_session``, each function call's JSON arguments to
  ``/<name>`` (the answer body, error or not, is the tool output the model sees), then the row plus
  ``response`` to ``/verify``, carrying the cookies along.
- ``nemo_gym/openai_utils.py``: the ``response`` output items (``message`` with ``output_text``,
  ``function_call``, ``function_call_output``); dataset rows are JSONL with ``responses_create_params``
  (``input``, ``tools``) plus task fields the server reads (e.g. ``expected_count``).

There is no ``/close_session`` route in that contract (``close_session`` is a server-side method of
``resources_servers/gymnasium/base.py``), so nothing is posted at the end: the session ends with its cookie.

Episodes are played by our own tool-calling harness (``chat-tools``, exact TITO): the session exposes
the row's tools, each call goes to the tool route, and ``score`` sends the episode to ``/verify`` as a
NeMo Gym response.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.errors import UserError, require
from miles_agent.sandbox import Sandbox
from miles_agent.tool_calls import TOOL_CALL_BLOCK, scan_tool_calls

URL_ENV = "NEMO_GYM_RESOURCES_URL"
# Routes of the contract itself: never reachable as a "tool" the model names.
_RESERVED = frozenset({"seed_session", "verify", "aggregate_metrics", "reverify_mode", "mcp"})


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not JSON ({e}); NeMo Gym datasets are one JSON object per line") from None
        if not isinstance(row, dict) or "responses_create_params" not in row:
            raise UserError(f"{path}:{n} has no 'responses_create_params'; each NeMo Gym row needs it "
                            "(with 'input' and 'tools')")
        rows.append(row)
    return rows


def chat_messages(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses-API ``input`` (a string or a list of messages) as chat messages."""
    out = [{"role": "system", "content": params["instructions"]}] if params.get("instructions") else []
    items = params.get("input", [])
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items:
        if item.get("type", "message") != "message":
            raise UserError(f"NeMo Gym input item of type {item.get('type')!r} is not supported; only messages")
        content = item.get("content", "")
        if isinstance(content, list):  # [{"type": "input_text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if p.get("type") in ("input_text", "output_text"))
        role = "system" if item.get("role") == "developer" else item.get("role", "user")
        out.append({"role": role, "content": content})
    return out


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses-API function tools (flat ``name``/``parameters``) in the chat-completions shape."""
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise UserError(f"NeMo Gym tool {t.get('name') or t.get('type')!r} is not a function tool; "
                            "only function tools are supported")
        fn = t.get("function") or {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


class NemoGymSession(EnvSession):
    """One rollout: a seeded resources-server session (its cookie), the calls made, then /verify."""

    def __init__(self, env: NemoGymEnv, task: Task) -> None:
        self.env, self.row = env, task.info["row"]
        self.tools = chat_tools(self.row["responses_create_params"].get("tools") or [])
        self.tool_names = {t["function"]["name"] for t in self.tools} - _RESERVED
        self.calls: list[dict[str, Any]] = []  # {"name", "arguments", "output"} in call order
        aiohttp = require("aiohttp", "proxy", "the NeMo Gym adapter")
        # unsafe=True: aiohttp's default jar ignores cookies set by IP-address hosts such as 127.0.0.1.
        self.http = aiohttp.ClientSession(env.url, cookie_jar=aiohttp.CookieJar(unsafe=True),
                                          timeout=aiohttp.ClientTimeout(total=env.timeout_s))

    async def _post(self, route: str, body: dict[str, Any]) -> tuple[int, str]:
        async with self.http.post(route, json=body) as r:
            return r.status, await r.text()

    async def seed(self) -> None:
        status, text = await self._post("/seed_session", self.row)
        if status >= 400:
            raise RuntimeError(f"NeMo Gym /seed_session answered {status}: {text[:500]}")

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self.tool_names:
            raise ToolError(f"unknown tool {name!r}; this task's tools are {sorted(self.tool_names)}")
        _, text = await self._post(f"/{name}", arguments)  # as SimpleAgent: any answer is the tool output
        self.calls.append({"name": name, "arguments": arguments, "output": text})
        return text

    def response(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The episode as a NeMo Gym (OpenAI Responses) response: messages, function calls and outputs."""
        prompt_len = len(chat_messages(self.row["responses_create_params"]))
        output: list[dict[str, Any]] = []
        pending = list(self.calls)
        for m in messages[prompt_len:]:
            if m.get("role") != "assistant":
                continue
            content = m.get("content") or ""
            blocks = scan_tool_calls(content)  # only blocks that parsed were run as calls
            n_calls = len(m["tool_calls"]) if m.get("tool_calls") else sum(b.ok for b in blocks)
            text = TOOL_CALL_BLOCK.sub("", content).strip()
            if text:
                output.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                               "status": "completed",
                               "content": [{"type": "output_text", "text": text, "annotations": []}]})
            for call in pending[:n_calls]:
                call_id = f"call_{uuid.uuid4().hex[:16]}"
                output.append({"type": "function_call", "call_id": call_id, "name": call["name"],
                               "arguments": json.dumps(call["arguments"]), "status": "completed"})
                output.append({"type": "function_call_output", "call_id": call_id, "output": call["output"]})
            pending = pending[n_calls:]
        params = self.row["responses_create_params"]
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(),
                "model": params.get("model") or "policy", "output": output,
                "parallel_tool_calls": params.get("parallel_tool_calls", True),
                "tool_choice": params.get("tool_choice", "auto"), "tools": params.get("tools") or []}

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        status, text = await self._post("/verify", {**self.row, "response": self.response(messages)})
        if status >= 400:
            raise RuntimeError(f"NeMo Gym /verify answered {status}: {text[:500]}")
        body = json.loads(text)
        parts = {k: float(v) for k, v in (body.get("reward_components") or {}).items()}
        return Reward(float(body["reward"]), parts)

    async def close(self) -> None:
        await self.http.close()


class NemoGymEnv(Environment):
    name = "nemo-gym"
    description = "A NeMo Gym resources server (seed_session / tool routes / verify over HTTP) and its JSONL tasks."
    default_harness: ClassVar[str] = "chat-tools"

    def __init__(self, url: str | None = None, tasks: str | None = None, tasks_dir: str | None = None,
                 timeout_s: float = 60.0) -> None:
        self.url = (url or os.environ.get(URL_ENV, "")).rstrip("/")
        if not self.url:
            raise UserError(f"nemo-gym needs the resources server's URL: pass url= or set {URL_ENV}=http://HOST:PORT")
        self.timeout_s = timeout_s
        self.paths = self._jsonl(tasks, tasks_dir)
        self._tasks: list[Task] | None = None

    @staticmethod
    def _jsonl(tasks: str | None, tasks_dir: str | None) -> list[Path]:
        if tasks:
            return [Path(tasks)]
        if tasks_dir:  # `--tasks FOLDER` (e.g. a resources server's data/): every *.jsonl in it
            paths = sorted(Path(tasks_dir).glob("*.jsonl"))
            if paths:
                return paths
            raise UserError(f"{tasks_dir} holds no *.jsonl; point --tasks at a folder of NeMo Gym JSONL datasets")
        raise UserError("nemo-gym needs tasks: pass tasks=FILE.jsonl or --tasks FOLDER (NeMo Gym JSONL rows)")

    def tasks(self, split: str = "train") -> list[Task]:
        if self._tasks is None:
            rows = [row for p in self.paths for row in read_rows(p)]
            self._tasks = [Task(id=str(i), messages=tuple(chat_messages(r["responses_create_params"])),
                                info={"row": r}) for i, r in enumerate(rows)]
        return self._tasks

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> NemoGymSession:
        session = NemoGymSession(self, task)
        try:
            await session.seed()
        except BaseException:
            await session.close()
            raise
        return session
