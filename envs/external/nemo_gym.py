"""NeMo Gym adapter: a NeMo Gym resources server, driven over its HTTP contract.

The resources server is NeMo Gym's own process (nemo-gym 0.4 on Python >= 3.12: ``ng_run``, or a
server app under uvicorn); this adapter needs only aiohttp to speak its contract, so it runs natively
in the trainer (no side-car). The tests run the real nemo-gym package in its own venv
(`NEMO_GYM_VENV`). The contract, as read from NVIDIA-NeMo/Gym:

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
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.envs.external.venv import PackageVenv
from miles_agent.errors import UserError, require
from miles_agent.sandbox import Sandbox
from miles_agent.tool_calls import TOOL_CALL_BLOCK, scan_tool_calls

URL_ENV = "NEMO_GYM_RESOURCES_URL"
#: The real package, for serving resources servers here (tests; `python -m ...prepare nemo-gym`).
NEMO_GYM_VENV = PackageVenv("nemo-gym", ("nemo-gym==0.4.0",), "3.12")
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
            other = sorted({p.get("type") for p in content} - {"input_text", "output_text"})
            if other:  # an image the model would never see: refused, not silently dropped
                raise UserError(f"NeMo Gym input parts of type {other} are not supported (the chat is text "
                                "only); use a text dataset")
            content = "".join(p.get("text", "") for p in content)
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

    async def replay(self, rollout: dict[str, Any]) -> None:
        """`--policy oracle`: NeMo Gym's own example rollout of this row -- its function calls go to the
        tool routes of this seeded session, and its recorded response is what /verify then scores."""
        for item in rollout["response"].get("output") or ():
            if item.get("type") == "function_call" and item.get("name") in self.tool_names:
                await self._post(f"/{item['name']}", json.loads(item.get("arguments") or "{}"))
        self.recorded = rollout["response"]

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        sent = {**self.row, "response": getattr(self, "recorded", None) or self.response(messages)}
        status, text = await self._post("/verify", sent)
        if status >= 400:
            raise RuntimeError(f"NeMo Gym /verify answered {status}: {text[:500]}")
        body = json.loads(text)
        parts = {k: float(v) for k, v in (body.get("reward_components") or {}).items()}
        # What the server added to the request beyond the reward (judge scores, pass rates ...), kept.
        parts.update({k: float(v) for k, v in body.items() if k not in sent and k not in ("reward", "reward_components")
                      and isinstance(v, int | float) and not isinstance(v, bool)})
        return Reward(float(body["reward"]), parts)

    async def close(self) -> None:
        await self.http.close()


@dataclass(frozen=True)
class NemoGymOptions:
    url: str = ""  # the resources server (default $NEMO_GYM_RESOURCES_URL)
    tasks: str = ""  # one JSONL dataset file
    config: str = ""  # an ng_run YAML config: its datasets (by type) and the resources server's host/port
    split: str = ""  # read this dataset type (train | validation | example) whatever split the loop asks
    timeout_s: float = 60.0


#: Dataset files by the split the loop asks for (NeMo Gym's dataset types: train, validation, example).
_SPLITS = {"train": "train", "eval": "validation", "validation": "validation", "example": "example"}


class NemoGymEnv(Environment):
    name = "nemo-gym"
    description = "A NeMo Gym resources server (seed_session / tool routes / verify over HTTP) and its JSONL tasks."
    default_harness: ClassVar[str] = "chat-tools"
    options_type: ClassVar[type] = NemoGymOptions
    options_docs: ClassVar[str] = "docs/ecosystem.md"
    reward_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)  # a resources server's verify bounds none

    def __init__(self, url: str = "", tasks: str = "", tasks_dir: str | None = None, config: str = "",
                 split: str = "", timeout_s: float = 60.0) -> None:
        datasets, server_url = read_ng_config(Path(config)) if config else ({}, "")
        self.url = (url or os.environ.get(URL_ENV, "") or server_url).rstrip("/")
        if not self.url:
            raise UserError(f"nemo-gym needs the resources server's URL: set env.options.url=http://HOST:PORT "
                            f"or {URL_ENV}")
        self.timeout_s, self.split = timeout_s, split
        self.datasets = self._datasets(tasks, tasks_dir, datasets)
        self._tasks: dict[str, list[Task]] = {}
        self._open: dict[str, NemoGymSession] = {}  # the latest session per task, for `oracle_solve`

    @staticmethod
    def _datasets(tasks: str, tasks_dir: str | None, from_config: dict[str, list[Path]]) -> dict[str, list[Path]]:
        """Dataset files by type. A folder (a resources server's ``data/``): ``train*.jsonl``,
        ``validation*.jsonl``, ``example*.jsonl``; ``example_rollouts*.jsonl`` are recorded rollouts
        (the oracle's), never tasks."""
        if tasks:
            return {"": [Path(tasks)]}
        if from_config:
            return from_config
        if not tasks_dir:
            raise UserError("nemo-gym needs tasks: --tasks FOLDER (a data/ folder), env.options.tasks=FILE.jsonl "
                            "or env.options.config=ng_run.yaml")
        files = [p for p in sorted(Path(tasks_dir).glob("*.jsonl")) if not p.name.startswith("example_rollouts")]
        if not files:
            raise UserError(f"{tasks_dir} holds no *.jsonl datasets; point --tasks at a NeMo Gym data/ folder")
        by_type = {t: [p for p in files if p.name.startswith(t)] for t in ("train", "validation", "example")}
        by_type = {t: ps for t, ps in by_type.items() if ps}
        rest = [p for p in files if not any(p in ps for ps in by_type.values())]
        return by_type or {"": rest}

    def files(self, split: str) -> list[Path]:
        kind = self.split or _SPLITS.get(split, split)
        if "" in self.datasets:
            return self.datasets[""]
        if kind in self.datasets:
            return self.datasets[kind]
        for fallback in ("example", "train", "validation"):  # a checkout ships example.jsonl only
            if fallback in self.datasets:
                return self.datasets[fallback]
        raise UserError(f"no {kind} dataset; have {sorted(self.datasets)} (set env.options.split)")

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self._tasks:
            rows = [row for p in self.files(split) for row in read_rows(p)]
            self._tasks[split] = [Task(id=str(i), messages=tuple(chat_messages(r["responses_create_params"])),
                                       info={"row": r}) for i, r in enumerate(rows)]
        return self._tasks[split]

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> NemoGymSession:
        session = NemoGymSession(self, task)
        try:
            await session.seed()
        except BaseException:
            await session.close()
            raise
        self._open[task.id] = session
        return session

    def example_rollouts(self) -> list[dict[str, Any]]:
        folders = {p.parent for ps in self.datasets.values() for p in ps}
        return [r for d in sorted(folders) for f in sorted(d.glob("example_rollouts*.jsonl")) for r in read_rows(f)]

    async def oracle_solve(self, task: Task, sandbox: Sandbox | None = None) -> None:
        """`--policy oracle`: replay NeMo Gym's recorded example rollout of this task's row."""
        prompt = chat_messages(task.info["row"]["responses_create_params"])  # rollouts store the input expanded
        match = [r for r in self.example_rollouts()
                 if "response" in r and chat_messages(r["responses_create_params"]) == prompt]
        if not match:
            raise UserError(f"nemo-gym: no example_rollouts*.jsonl row records task {task.id}'s input; NeMo Gym "
                            "records rollouts for its example split: eval with env.options.split=example")
        await self._open.pop(task.id).replay(match[0])


def read_ng_config(path: Path) -> tuple[dict[str, list[Path]], str]:
    """An ng_run YAML config: the datasets its agents list (by type; ``jsonl_fpath`` is relative to the
    Gym checkout, found as the first folder above the config holding it) and the resources server's
    ``host``/``port`` when the config sets them."""
    import yaml

    if not path.is_file():
        raise UserError(f"env.options.config: {path} is not a file; give an ng_run YAML config")
    datasets: dict[str, list[Path]] = {}
    url = ""

    def walk(node: Any) -> None:
        nonlocal url
        if isinstance(node, dict):
            if "jsonl_fpath" in node:
                datasets.setdefault(str(node.get("type") or node.get("name") or ""), []).append(_locate(path, node["jsonl_fpath"]))
            if "resources_servers" in node and isinstance(node["resources_servers"], dict):
                for server in node["resources_servers"].values():
                    if isinstance(server, dict) and server.get("port"):
                        url = url or f"http://{server.get('host') or '127.0.0.1'}:{server['port']}"
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(yaml.safe_load(path.read_text()) or {})
    datasets = {k: [p for p in ps if p.is_file()] for k, ps in datasets.items()}
    datasets = {k: ps for k, ps in datasets.items() if ps}
    if not datasets:
        raise UserError(f"{path}: none of its datasets' jsonl_fpath files exist here (NeMo Gym downloads train/"
                        "validation data separately); give --tasks DATA_FOLDER instead")
    return datasets, url


def _locate(config: Path, fpath: str) -> Path:
    for base in [Path.cwd(), *config.resolve().parents]:
        if (base / fpath).exists():
            return base / fpath
    return Path(fpath)
