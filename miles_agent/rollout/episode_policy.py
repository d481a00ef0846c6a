"""The policy one episode sees: the engine, plus a seed per request, a staleness check per span, and
word of weight-update preemptions.

Why a wrapper: the scheduler decides what a weight update does to an episode in flight and how old
its samples may be, but the harness only knows `Policy.generate`. This wrapper turns those decisions
into interruptions that leave the harness (its session and sandbox are still closed on the way out) and
that the scheduler catches: `Preempted` (restart the episode) and `StaleEpisode` (recycle or drop it).

Seeds: a request without its own ``sampling.seed`` gets one derived from (run seed, group position,
sample index, attempt, call index), so what an episode samples is a function of its place in the task
stream -- independent of which other requests share the engine's batch, and of arrival order. That
is what makes one-step-off runs resume exactly, and it leaves the engine no RNG state to checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace

from miles_agent.engine import Completion, FinishReason, Policy, SamplingParams


class EpisodeInterrupted(BaseException):  # noqa: N818 - an event, not an error
    """The scheduler takes this episode back. A BaseException, like asyncio.CancelledError, so that no
    ``except Exception`` in a harness or runner mistakes it for a failure of the task."""


class Preempted(EpisodeInterrupted):
    """The engine aborted this episode's request for a weight update (``partial_rollout=abort``)."""


class StaleEpisode(EpisodeInterrupted):
    """A span of this episode is already more than ``max_staleness`` weight versions old."""

    def __init__(self, staleness: int) -> None:
        super().__init__(f"a span is {staleness} weight versions old")
        self.staleness = staleness


def request_seed(*parts: int) -> int:
    """A stable 62-bit seed from integers (Python's hash() is salted per process, so not that)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def completion_versions(c: Completion) -> list[int]:
    """Every weight version that sampled part of ``c`` (several when weights changed under it)."""
    return [int(v) for v, _ in c.meta.get("weight_versions") or ()] or [int(c.weight_version)]


class EpisodePolicy:
    """`Policy` for one episode attempt (see module docstring)."""

    def __init__(self, engine: Policy, seed_parts: tuple[int, ...], *, epoch: Callable[[], int],
                 version: Callable[[], int], max_staleness: int | None) -> None:
        self.engine = engine
        self.seed_parts = seed_parts
        self.epoch = epoch  # bumped by the scheduler before it aborts requests for a weight update
        self.version = version  # the engines' current weight version
        self.max_staleness = max_staleness
        self.calls = 0
        self.oldest: int | None = None

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False, **images: object) -> Completion:
        if sampling.seed is None:
            sampling = replace(sampling, seed=request_seed(*self.seed_parts, self.calls))
        self.calls += 1
        epoch = self.epoch()
        c = await self.engine.generate(input_ids, sampling, return_routed_experts=return_routed_experts, **images)
        if c.finish_reason is FinishReason.ABORT and self.epoch() != epoch:
            raise Preempted()
        oldest = min(completion_versions(c))
        self.oldest = oldest if self.oldest is None else min(self.oldest, oldest)
        staleness = int(self.version()) - self.oldest
        if self.max_staleness is not None and staleness > self.max_staleness:
            raise StaleEpisode(staleness)
        return c
