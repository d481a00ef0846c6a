"""The external harness: another package's own agent loop plays the episode through the proxy.

For adapter environments (`miles_agent.envs.external`): the proxy records every model call
token-in-token-out, the session's `play` runs the package's episode (its harness, its agent, its
verifier) in the package's side-car, and the package's reward becomes the trajectory's reward.
Outcomes as for the black-box harness: engine abort -> ABORTED; a turn/token limit or the timeout ->
TRUNCATED; the package failing or never calling the model -> FAILED; otherwise COMPLETED.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles_agent.engine import Policy, SamplingParams
from miles_agent.environment import EnvSession, Harness, HarnessLimits, Task
from miles_agent.errors import UserError
from miles_agent.harnesses.blackbox import AgentOutcome, BlackBoxHarness, EnvTools
from miles_agent.harnesses.proxy import ProxyLimits, ProxyServer
from miles_agent.types import Status, Trajectory


class ExternalHarness(BlackBoxHarness):
    name = "external"
    description = "The environment package's own agent loop (Verifiers, OpenEnv, Harbor ...) through the proxy."
    env_keys = ("agent_timeout_s",)  # the agent is the package's own

    def __init__(self, tokenizer: Any, limits: HarnessLimits, sampling: SamplingParams, *,
                 agent_timeout_s: float = 600.0) -> None:
        Harness.__init__(self)
        self.tokenizer, self.limits, self.sampling = tokenizer, limits, sampling
        self.agent_timeout_s = agent_timeout_s

    async def run(self, task: Task, session: EnvSession, policy: Policy) -> list[Trajectory]:
        if not hasattr(session, "play"):
            raise UserError("the external harness plays only adapter environments (Verifiers, OpenEnv, "
                            "Harbor ...); use env.harness=chat-tools or black-box for this environment")
        tools = EnvTools(task, session, self.tokenizer, self.limits.max_observation_tokens)
        limits = ProxyLimits(max_turns=self.limits.max_turns, max_total_tokens=self.limits.max_total_tokens,
                             max_new_tokens_per_turn=self.limits.max_new_tokens_per_turn)
        async with ProxyServer(policy, self.tokenizer, sampling=self.sampling, limits=limits,
                               honor_client_sampling=False) as server:
            proxy = server.open_session()
            outcome = AgentOutcome()
            try:
                result = await session.play(proxy.base_url, proxy.api_key, self.agent_timeout_s)
                outcome.log = str(result.get("info", ""))[-4096:]
            except TimeoutError:
                outcome = AgentOutcome(error=f"timed out after {self.agent_timeout_s:g}s", timed_out=True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the package's failure is the episode's outcome
                outcome = AgentOutcome(error=f"{type(e).__name__}: {e}"[-4096:])
            server.close_session(proxy)
        trajs = await self._finish(task, session, proxy, tools, outcome)
        return self._per_player(trajs, getattr(session, "result", None) or {})

    def _per_player(self, trajs: list[Trajectory], result: dict[str, Any]) -> list[Trajectory]:
        """A multi-player episode (a verifiers env with two seats) reports one trace per player: each proxy
        trajectory whose prompt holds exactly one player's opening message (else whose text holds exactly
        one player's last reply) takes that player's reward and parts, and names the player in its
        metadata. An unmatched trajectory keeps the episode's reward."""
        players = list(result.get("traces") or ())
        if len(players) < 2:
            return trajs
        taken: set[int] = set()
        for t in trajs:
            if t.status not in (Status.COMPLETED, Status.TRUNCATED):
                continue
            prompt, sampled = self.tokenizer.decode(list(t.prompt_ids)), self.tokenizer.decode(list(t.tokens))
            free = [p for i, p in enumerate(players) if i not in taken]
            match = [p for p in free if p.get("first") and p["first"] in prompt]
            if len(match) != 1:  # players with the same opening (attempts at one task): by the last reply
                match = [p for p in (match or free) if p.get("reply") and p["reply"].strip() in sampled]
            if len(match) > 1 and all(p.get("reply") == match[0].get("reply") for p in match):
                match = match[:1]  # identical attempts: any one of them is this trajectory's
            if len(match) == 1:
                taken.add(next(i for i, p in enumerate(players) if p is match[0]))
                t.reward = float(match[0]["reward"])
                t.reward_parts = {k: float(v) for k, v in match[0].get("parts", {}).items()}
                t.metadata["player"] = match[0]["name"]
        return trajs
