"""Collecting the engine's routed experts for R3 without changing any harness.

Harnesses call ``policy.generate`` and build trajectories themselves; they need not know about MoE
routing. `RoutingCapture` stands between them and the engine: it asks the engine for the routed
experts of every call and keeps them keyed by the call's full token sequence (input + output). After
the rollout, `attach` gives each trajectory the routing of the call that sampled its last model span:
that call ran the whole history through the model, so its rows cover every token up to there
(``routed_experts`` convention: one row per token except the last sampled one). Tokens after the last
model span (a final observation) were never routed; their rows are -1, which the trainer's replay
treats as "route naturally" -- they precede no sampled token, so they cannot change a trained logprob.
"""

from __future__ import annotations

import numpy as np

from miles_agent.engine import Completion, Policy, SamplingParams
from miles_agent.types import SpanKind, Trajectory


class RoutingCapture:
    """A `Policy` that records routed experts per call (see the module docstring)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._routing: dict[tuple[int, ...], np.ndarray] = {}

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        c = await self.policy.generate(input_ids, sampling, return_routed_experts=True)
        if c.routed_experts is not None:
            self._routing[tuple(input_ids) + tuple(c.output_ids)] = c.routed_experts
        return c if return_routed_experts else _without_routing(c)

    def attach(self, trajectories: list[Trajectory]) -> int:
        """Set ``routed_experts`` on every trajectory with a model span; returns how many had none recorded
        (marked ``metadata["routing_missing"]``, all rows -1: trained with the trainer's own routing).
        Clears the store."""
        missing = 0
        for t in trajectories:
            last = next((s for s in reversed(t.spans) if s.kind is SpanKind.MODEL), None)
            if last is None:
                continue
            end = len(t.prompt_ids) + last.end
            routed = self._routing.get(tuple(t.tokens[:end]))
            if routed is None:
                t.metadata["routing_missing"] = True
                missing += 1
                shape = next(iter(self._routing.values()), np.zeros((0, 0, 0))).shape[1:]
                if not all(shape):
                    continue
                routed = np.zeros((0, *shape), dtype=np.int32)
            rows = np.full((len(t.tokens) - 1, *routed.shape[1:]), -1, dtype=np.int32)
            rows[:len(routed)] = routed
            t.routed_experts = rows
        self._routing.clear()
        return missing


def _without_routing(c: Completion) -> Completion:
    return Completion(c.output_ids, c.output_logprobs, c.finish_reason, c.weight_version, c.prompt_tokens,
                      None, c.meta)
