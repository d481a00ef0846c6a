"""The black-box harness: any agent program plays the episode through the OpenAI-compatible proxy.

The agent is either a command (run as a subprocess with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``MILES_ENV_URL`` and ``MILES_TASK_ID`` in its environment) or an async function given an `AgentContext`
(the same URLs and key, plus the task). It talks to the model as it would to OpenAI, and to the
environment through ``$MILES_ENV_URL/task`` (opening messages and tool schemas) and
``$MILES_ENV_URL/tools/call``. The proxy records every model call token-in-token-out; when the agent is
done the environment's verifier scores the conversation the agent last sent, as with every harness.

Outcomes: a generation aborted by the engine -> ABORTED (the episode is retried); a turn/token limit or
the agent's timeout -> TRUNCATED (scored); an agent that crashes or never calls the model -> FAILED
(not trained on, with its exit code and log tail in the metadata); otherwise COMPLETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles_agent.engine import Policy, SamplingParams
from miles_agent.environment import EnvSession, Harness, HarnessLimits, Task
from miles_agent.errors import UserError
from miles_agent.harnesses.proxy import ProxyLimits, ProxyServer, Session
from miles_agent.types import Status, Trajectory

_LOG_TAIL = 4096  # bytes of agent output kept for the trajectory's metadata


@dataclass(frozen=True)
class AgentContext:
    """What an in-process agent function gets: the proxy endpoint and key, the task, and its tools."""

    base_url: str
    api_key: str
    env_url: str
    task_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    call_tool: Callable[[str, dict[str, Any]], Awaitable[str]]


AgentFn = Callable[[AgentContext], Awaitable[Any]]


@dataclass
class AgentOutcome:
    error: str = ""  # why the agent failed ("" = it finished normally)
    timed_out: bool = False
    exit_code: int | None = None
    log: str = ""


class EnvTools:
    """The episode's task and tools as the proxy serves them at ``/sessions/{id}/env``."""

    def __init__(self, task: Task, session: EnvSession, tokenizer: Any, max_observation_tokens: int) -> None:
        self.task, self.session, self.tokenizer, self.cap = task, session, tokenizer, max_observation_tokens
        self.truncated = 0

    def describe(self) -> dict[str, Any]:
        return {"task_id": self.task.id, "messages": [dict(m) for m in self.task.messages],
                "tools": list(self.session.tools)}

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        out = await self.session.call_tool(name, arguments)
        ids = self.tokenizer.encode(out, add_special_tokens=False)
        if len(ids) > self.cap:  # as the chat-tools harness does: cut long output and say so
            self.truncated += 1
            out = self.tokenizer.decode(ids[:self.cap]) + f"\n[output truncated: {len(ids) - self.cap} more tokens]"
        return out


class BlackBoxHarness(Harness):
    name = "black-box"
    description = "Any agent program (command or async function) playing through the OpenAI-compatible proxy."
    env_keys = ("agent", "agent_timeout_s")

    def __init__(self, tokenizer: Any, limits: HarnessLimits, sampling: SamplingParams, *,
                 agent: str | AgentFn = "", agent_timeout_s: float = 600.0) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.sampling = sampling
        self.agent = resolve_agent(agent)
        self.agent_timeout_s = agent_timeout_s

    async def run(self, task: Task, session: EnvSession, policy: Policy) -> list[Trajectory]:
        tools = EnvTools(task, session, self.tokenizer, self.limits.max_observation_tokens)
        limits = ProxyLimits(max_turns=self.limits.max_turns, max_total_tokens=self.limits.max_total_tokens,
                             max_new_tokens_per_turn=self.limits.max_new_tokens_per_turn)
        # The trainer's logprobs assume the configured sampling, so the agent's temperature is not honoured.
        async with ProxyServer(policy, self.tokenizer, sampling=self.sampling, limits=limits,
                               honor_client_sampling=False) as server:
            proxy = server.open_session(tool_host=tools)
            outcome = await self._play(proxy, task, tools)
            server.close_session(proxy)
        return await self._finish(task, session, proxy, tools, outcome)

    async def _play(self, proxy: Session, task: Task, tools: EnvTools) -> AgentOutcome:
        if callable(self.agent):
            ctx = AgentContext(proxy.base_url, proxy.api_key, proxy.env_url, task.id,
                               tools.describe()["messages"], tools.describe()["tools"], tools.call)
            try:
                await asyncio.wait_for(self.agent(ctx), self.agent_timeout_s)
            except TimeoutError:
                return AgentOutcome(error=f"timed out after {self.agent_timeout_s:g}s", timed_out=True)
            except Exception as e:  # noqa: BLE001 - the agent's failure is the episode's outcome
                return AgentOutcome(error=f"{type(e).__name__}: {e}")
            return AgentOutcome()
        # The proxy is on loopback: keep an HTTP(S)_PROXY of the host from intercepting the agent's calls.
        no_proxy = ",".join(filter(None, ["127.0.0.1,localhost,::1", os.environ.get("NO_PROXY", "")]))
        env = {**os.environ, "OPENAI_BASE_URL": proxy.base_url, "OPENAI_API_KEY": proxy.api_key,
               "MILES_ENV_URL": proxy.env_url, "MILES_TASK_ID": task.id, "NO_PROXY": no_proxy, "no_proxy": no_proxy}
        return await run_command(self.agent, env, self.agent_timeout_s)

    async def _finish(self, task: Task, session: EnvSession, proxy: Session, tools: EnvTools,
                      outcome: AgentOutcome) -> list[Trajectory]:
        trajs = proxy.trajectories()
        notes = {"agent_log": outcome.log[-_LOG_TAIL:], "agent_exit_code": outcome.exit_code,
                 "turns": proxy.turns, "observation_truncated": tools.truncated}
        if outcome.error:
            notes["agent_error"] = outcome.error
        if proxy.truncated:
            notes["truncated"] = proxy.truncated
        for t in trajs:
            t.task_id = task.id
            t.metadata.update(notes)
        if proxy.aborted:
            for t in trajs:
                t.status = Status.ABORTED
            return trajs
        if not trajs or (outcome.error and not outcome.timed_out and not proxy.truncated):
            why = outcome.error or "the agent finished without calling the model"
            failed = Trajectory(prompt_ids=[], task_id=task.id, status=Status.FAILED)
            failed.metadata.update(notes, error=f"black-box agent: {why}")
            return [failed]
        reward = await session.score(proxy.messages())
        status = Status.TRUNCATED if (proxy.truncated or outcome.timed_out) else Status.COMPLETED
        for t in trajs:
            t.reward, t.reward_parts, t.status = reward.value, dict(reward.parts), status
        return trajs


def resolve_agent(agent: str | AgentFn) -> list[str] | AgentFn:
    """A command line (``python`` means this interpreter) or ``module:function`` -> argv or the function."""
    if callable(agent):
        return agent
    if not isinstance(agent, str) or not agent.strip():
        raise UserError("the black-box harness needs an agent: set env.agent to a command, e.g. "
                        "env.agent='python -m miles_agent.harnesses.agents.openai_tool_loop', or to "
                        "module:function of an async function taking an AgentContext")
    if re.fullmatch(r"[\w.]+:[\w.]+", agent.strip()):
        module, _, attr = agent.strip().partition(":")
        try:
            fn: Any = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError) as e:
            raise UserError(f"cannot load the agent {agent!r}: {type(e).__name__}: {e}; check env.agent") from None
        if not callable(fn):
            raise UserError(f"the agent {agent!r} is not callable; point env.agent at an async function")
        return fn
    argv = shlex.split(agent)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    if shutil.which(argv[0]) is None:
        raise UserError(f"the agent command {argv[0]!r} (env.agent) is not an executable on PATH; give a path "
                        "to the program or module:function of an async agent")
    return argv


async def run_command(argv: list[str], env: dict[str, str], timeout_s: float) -> AgentOutcome:
    """Run an agent program in its own process group; kill the whole group on timeout or cancellation."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return AgentOutcome(error=f"cannot start {argv[0]!r}: {e}")
    tail = bytearray()

    async def drain() -> None:
        while chunk := await proc.stdout.read(65536):
            tail.extend(chunk)
            del tail[:-_LOG_TAIL]

    reader = asyncio.ensure_future(drain())
    outcome = AgentOutcome()
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
    except TimeoutError:
        outcome = AgentOutcome(error=f"timed out after {timeout_s:g}s", timed_out=True)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader, 5)
    outcome.exit_code = proc.returncode
    outcome.log = tail.decode(errors="replace")
    if not outcome.error and proc.returncode != 0:
        outcome.error = f"exited with code {proc.returncode}"
    return outcome
