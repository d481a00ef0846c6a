"""Collecting the engine's routed experts for R3 without changing any harness.

Harnesses call ``policy.generate`` and build trajectories themselves; they need not know about MoE
routing. `RoutingCapture` stands between them and the engine: it asks the engine for the routed
experts of every call and keeps them keyed by the call's full token sequence (input + output), with
the weight versions that sampled it. When an episode ends, `attach` gives each of its trajectories
the routing of the calls that built it (``routed_experts`` convention: one row per token except the
last sampled one) and forgets those calls.

Which call's rows: each row comes from the first call that ran that token through the model -- the
call that sampled the tokens right after it. A later turn re-runs the whole history, and when the
weights changed between turns (async mode) its routing of the earlier turns is that of the newer
weights, not the one that gave those turns' logprobs; replaying the first call's rows keeps every
sampled token on the routing that sampled it. (One forward replays one routing per token, so the later
turns' context then differs from their own call's; that costs far less: with an update between two
turns, the replayed logprobs are ~1500x closer to each call's own routing than with the last call's
rows, ``python bench/routing_replay_turns.py``.) Within one call the engine's own rows are used as they
are: a request the weights changed under keeps its old rows for tokens before the update
(``partial_rollout=keep``), a retracted one returns its re-prefill's rows (``retract``). Tokens after
the last model span (a final observation) were never routed; their rows are -1, which the trainer's
replay treats as "route naturally" -- they precede no sampled token, so they cannot change a trained
logprob.

Memory bound: `forget_older_than(version - max_staleness)` (the scheduler calls it as episodes end
and after each weight update) drops every record a trainable sample can no longer use: a call first
sampled by a version older than that belongs to an episode the scheduler would recycle or drop as
stale. Calls consumed by an attached trajectory are dropped at once. So the store holds at most the
calls the engine answered in the last ``max_staleness + 1`` weight versions -- in practice those of
episodes in flight, plus the attempts abandoned since (preempted, recycled, retried), which the
scheduler caps per sample (``max_recycles``, the runner's ``max_retries``, one preemption per update).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from miles_agent.engine import Completion, FinishReason, Policy, SamplingParams
from miles_agent.rollout.episode_policy import completion_versions
from miles_agent.types import Span, SpanKind, Trajectory


@dataclass(eq=False)  # records are told apart by identity: two calls may return the same tokens
class _Call:
    routed: np.ndarray  # (len(input) + len(output) - 1, layers, top_k)
    oldest: int  # the oldest weight version that sampled part of the call
    last: int  # the version that sampled its last token


class RoutingCapture:
    """A `Policy` that records routed experts per call (see the module docstring)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._calls: dict[tuple[int, ...], list[_Call]] = {}
        self._shape: tuple[int, ...] | None = None  # (layers, top_k), once any call returned routing

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        c = await self.policy.generate(input_ids, sampling, return_routed_experts=True)
        if c.routed_experts is not None and c.finish_reason is not FinishReason.ABORT:  # aborted: never used
            versions = completion_versions(c)
            key = tuple(input_ids) + tuple(c.output_ids)
            self._calls.setdefault(key, []).append(_Call(c.routed_experts, min(versions), int(c.weight_version)))
            self._shape = c.routed_experts.shape[1:]
        return c if return_routed_experts else _without_routing(c)

    @property
    def stored_calls(self) -> int:
        return sum(len(v) for v in self._calls.values())

    def attach(self, trajectories: list[Trajectory]) -> int:
        """Set ``routed_experts`` on every trajectory with a model span (one episode's, or a batch) and
        forget the calls used; returns how many had no recorded call for their last model span
        (marked ``metadata["routing_missing"]``, all rows -1: trained with the trainer's own routing)."""
        missing, used = 0, set()
        for t in trajectories:
            end = _last_model_end(t)
            if end is None:
                continue  # nothing sampled: nothing to replay
            calls = self._calls_of(t, used)
            if not calls or calls[-1][0] != end:
                t.metadata["routing_missing"] = True
                missing += 1
                calls = []
            if self._shape is None:
                continue  # no call ever returned routing: nothing to size the rows by
            rows = np.full((len(t.tokens) - 1, *self._shape), -1, dtype=np.int32)
            filled = 0
            for _, call in calls:  # each row from the first call that ran its token (module docstring)
                rows[filled:len(call.routed)] = call.routed[filled:]
                filled = max(filled, len(call.routed))
            t.routed_experts = rows
        for key, call in used:
            self._calls[key].remove(call)
            if not self._calls[key]:
                del self._calls[key]
        return missing

    def forget_older_than(self, version: int) -> None:
        """Drop calls first sampled before ``version``: no trainable sample can use them any more."""
        for key in list(self._calls):
            kept = [c for c in self._calls[key] if c.oldest >= version]
            if kept:
                self._calls[key] = kept
            else:
                del self._calls[key]

    def _calls_of(self, t: Trajectory, used: set) -> list[tuple[int, _Call]]:
        """The recorded calls that end where ``t``'s calls ended, in order, as (end in tokens, call)."""
        found = []
        model = [s for s in t.spans if s.kind is SpanKind.MODEL]
        for span, after in zip(model, [*model[1:], None]):
            if after is not None and after.start == span.end and after.turn == span.turn:
                continue  # the weights changed mid-call: one call, split into a span per version
            end = len(t.prompt_ids) + span.end
            key = tuple(t.tokens[:end])
            call = _pick(self._calls.get(key, ()), span, {c for _, c in used})
            if call is not None:
                used.add((key, call))
                found.append((end, call))
        return found


def _pick(candidates: list[_Call] | tuple, span: Span, taken: set[_Call]) -> _Call | None:
    """Of the calls that returned these tokens, one sampled by the span's version, not yet taken by
    another trajectory of this attach if possible (two samples may draw the same tokens)."""
    return min(candidates, key=lambda c: (c.last != span.weight_version, c in taken), default=None)


def _last_model_end(t: Trajectory) -> int | None:
    last = next((s for s in reversed(t.spans) if s.kind is SpanKind.MODEL), None)
    return None if last is None else len(t.prompt_ids) + last.end


def _without_routing(c: Completion) -> Completion:
    return Completion(c.output_ids, c.output_logprobs, c.finish_reason, c.weight_version, c.prompt_tokens,
                      None, c.meta)
