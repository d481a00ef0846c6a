"""Collecting the engine's routed experts for R3 without changing any harness.

Harnesses call ``policy.generate`` and build trajectories themselves; they need not know about MoE
routing. `RoutingCapture` stands between them and the engine: the scheduler gives every episode
attempt its own recorder (`EpisodeRouting`, a `Policy`) that asks the engine for the routed experts of
each call and keeps them with the call's full token sequence (input + output). When the episode ends,
``attach`` gives each of its trajectories the routing of the calls that built it (``routed_experts``
convention: one row per token except the last sampled one); then the recorder is discarded, whatever
ended the attempt (finished, preempted, stale, retried).

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

Memory bound: routing lives only as long as its episode attempt. What is held at any time is the
calls of the attempts in flight -- at most ``rollout.concurrency`` of them, each at most
``max_staleness`` versions old (an older one stops at its next call as stale, see
`miles_agent.rollout.episode_policy`), each holding about one row per token of its history: a call
that continues an earlier call keeps only the rows that call did not have, so a 50-turn episode holds
~1x its tokens, not ~25x (plus the rows of any calls its harness made outside that history, and of the
tries the runner retried after an infrastructure error, at most ``max_retries``). Finished episodes
carry their rows in the trajectory (and in checkpoints), so nothing is held for samples waiting for
their batch, and an attempt given up on (preempted, stale) frees its calls at once: none waits to age
out.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from miles_agent.engine import Completion, FinishReason, Policy, SamplingParams
from miles_agent.types import SpanKind, Trajectory


@dataclass(eq=False)  # told apart by identity: two calls may return the same tokens
class _Call:
    key: tuple[int, ...]  # input + output token ids
    routed: np.ndarray  # rows start .. len(key) - 2 of the engine's (len(key) - 1, layers, top_k)
    start: int  # rows before it are held by ``prev``, the call whose tokens this call's input extends
    prev: _Call | None
    version: int  # the weight version that sampled the last token


class RoutingCapture:
    """Makes one routing recorder per episode attempt (see the module docstring)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.shape: tuple[int, ...] | None = None  # (layers, top_k), once any call returned routing
        self._live: weakref.WeakSet[EpisodeRouting] = weakref.WeakSet()

    def episode(self) -> EpisodeRouting:
        recorder = EpisodeRouting(self)
        self._live.add(recorder)
        return recorder

    @property
    def stored_calls(self) -> int:
        """Calls held now, over every attempt in flight."""
        return sum(len(r.calls) for r in list(self._live))


class EpisodeRouting:
    """The `Policy` one episode attempt calls: records each call's routing, attaches it at the end."""

    def __init__(self, capture: RoutingCapture) -> None:
        self.capture = capture
        self.calls: list[_Call] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        c = await self.capture.policy.generate(input_ids, sampling, return_routed_experts=True)
        if c.routed_experts is not None and c.finish_reason is not FinishReason.ABORT:  # aborted: never used
            prev = self._continued(input_ids)
            start = 0 if prev is None else len(prev.key) - 1  # prev's last sampled token: it never ran it
            routed = c.routed_experts[start:].copy() if start else c.routed_experts  # a view would keep it all
            self.calls.append(_Call(tuple(input_ids) + tuple(c.output_ids), routed, start, prev,
                                    int(c.weight_version)))
            self.capture.shape = c.routed_experts.shape[1:]
        return c if return_routed_experts else _without_routing(c)

    def _continued(self, input_ids: list[int]) -> _Call | None:
        """The latest call whose tokens this input starts with (the previous turn), if any."""
        for prev in reversed(self.calls):
            n = len(prev.key)
            if n <= len(input_ids) and tuple(input_ids[:n]) == prev.key:
                return prev
        return None

    def attach(self, trajectories: list[Trajectory]) -> int:
        """Set ``routed_experts`` on every trajectory with a model span, then forget this attempt's calls.
        Returns how many had no recorded call for their last model span (marked
        ``metadata["routing_missing"]``, all rows -1: the trainer routes them itself)."""
        by_key: dict[tuple[int, ...], list[_Call]] = {}
        for c in self.calls:
            by_key.setdefault(c.key, []).append(c)
        missing = 0
        for t in trajectories:
            last = next((s for s in reversed(t.spans) if s.kind is SpanKind.MODEL), None)
            if last is None:
                continue  # nothing sampled: nothing to replay
            end = len(t.prompt_ids) + last.end
            found = by_key.get(tuple(t.tokens[:end]), [])
            # the latest such call (an earlier one was a retried attempt's), of the span's version if any
            call = max(reversed(found), key=lambda c: c.version == last.weight_version, default=None)
            if call is None:
                t.metadata["routing_missing"] = True
                missing += 1
            if self.capture.shape is not None:
                t.routed_experts = _rows(call, end, len(t.tokens), self.capture.shape)
        self.discard()
        return missing

    def discard(self) -> None:
        self.calls = []


def _rows(call: _Call | None, end: int, n_tokens: int, shape: tuple[int, ...]) -> np.ndarray:
    """``routed_experts`` for a trajectory of ``n_tokens`` whose last model span ends at ``end``: each
    row from the first call that ran its token (``call`` and the calls it continued), -1 past them."""
    rows = np.full((n_tokens - 1, *shape), -1, dtype=np.int32)
    hi = end - 1
    while call is not None:
        rows[call.start:hi] = call.routed[:hi - call.start]
        hi, call = call.start, call.prev
    return rows


def _without_routing(c: Completion) -> Completion:
    return Completion(c.output_ids, c.output_logprobs, c.finish_reason, c.weight_version, c.prompt_tokens,
                      None, c.meta)
