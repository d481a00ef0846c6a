"""One proxy session = one episode: its secret, its policy, its token history, and optionally its tools.

`Session.chat` / `Session.complete` are what the HTTP handlers call; they can also be called directly
(same code path, no sockets), which is how the harness scores and how tests drive thousands of turns.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any, Protocol

from miles_agent.engine import FinishReason, Policy, SamplingParams
from miles_agent.harnesses.proxy.history import Pending, ProxyLimits, SessionHistory, Turn
from miles_agent.harnesses.proxy.protocol import ChatRequest, ClientSampling, CompletionRequest, ProxyError
from miles_agent.types import Trajectory


class ToolHost(Protocol):
    """Environment tools a session exposes at ``/sessions/{id}/env`` (the black-box harness's bridge)."""

    def describe(self) -> dict[str, Any]:
        """The task as the agent needs it: ``{"task_id", "messages", "tools"}``."""
        ...

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool; raise `miles_agent.environment.ToolError` for a call the model got wrong."""
        ...


class Session:
    """An episode's endpoint: ``base_url`` (``.../sessions/{id}/v1``) and ``api_key`` go to the agent."""

    def __init__(self, *, session_id: str, base_url: str, policy: Policy, tokenizer: Any, limits: ProxyLimits,
                 sampling: SamplingParams, honor_client_sampling: bool, tool_host: ToolHost | None = None,
                 return_routed_experts: bool = False) -> None:
        self.id = session_id
        self.api_key = "sk-miles-" + secrets.token_urlsafe(24)
        self.base_url = base_url
        self.env_url = base_url.rsplit("/v1", 1)[0] + "/env"
        self.policy = policy
        self.tokenizer = tokenizer
        self.limits = limits
        self.sampling = sampling
        self.honor_client_sampling = honor_client_sampling
        self.tool_host = tool_host
        self.return_routed_experts = return_routed_experts
        self.history = SessionHistory(tokenizer, limits, sampling.stop_token_ids)
        self.closed = False

    # -- what the owner reads ---------------------------------------------------------------------------
    def trajectories(self) -> list[Trajectory]:
        """One TITO trajectory per branch (reward and status are the owner's to set)."""
        return self.history.trajectories()

    def messages(self) -> list[dict[str, Any]]:
        """The conversation the agent saw last (its last request plus the reply), for the verifier."""
        return self.history.final_messages()

    @property
    def truncated(self) -> str:
        """Why a limit ended the session ("" when none did)."""
        return self.history.truncated

    @property
    def aborted(self) -> bool:
        return self.history.aborted

    @property
    def turns(self) -> int:
        return self.history.turns

    # -- what the handlers call ---------------------------------------------------------------------------
    async def chat(self, request: ChatRequest) -> Turn:
        pending = self.history.begin_chat(request.messages, request.tools, request.parse_tools)
        return await self._generate(pending, request.sampling)

    async def complete(self, request: CompletionRequest) -> Turn:
        return await self._generate(self.history.begin_text(request.prompt), request.sampling)

    async def _generate(self, pending: Pending, client: ClientSampling) -> Turn:
        sampling = self._sampling(client, len(pending.input_ids))
        try:
            completion = await self.policy.generate(pending.input_ids, sampling,
                                                    return_routed_experts=self.return_routed_experts)
        except BaseException as e:
            self.history.release(pending)
            if isinstance(e, Exception):
                raise ProxyError(500, f"the rollout engine failed: {type(e).__name__}: {e}",
                                 type="server_error", code="engine_error") from e
            raise
        turn = self.history.commit(pending, completion)
        if completion.finish_reason is FinishReason.ABORT:
            raise ProxyError(503, "the rollout engine aborted this generation (e.g. for a weight update); "
                             "the episode will be retried", type="server_error", code="generation_aborted",
                             retry=False)
        return turn

    def _sampling(self, client: ClientSampling, input_len: int) -> SamplingParams:
        cap = self.limits.max_new_tokens_per_turn
        max_new = min(client.max_tokens or cap, cap)
        if self.limits.max_total_tokens is not None:
            max_new = min(max_new, self.limits.max_total_tokens - input_len)
        s = replace(self.sampling, max_new_tokens=max_new, stop=tuple(dict.fromkeys(self.sampling.stop + client.stop)))
        if self.honor_client_sampling:
            s = replace(s, temperature=_pick(client.temperature, s.temperature), top_p=_pick(client.top_p, s.top_p),
                        top_k=_pick(client.top_k, s.top_k), seed=_pick(client.seed, s.seed))
        return s


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value
