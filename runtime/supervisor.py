"""EngineSupervisor: the driver's one rollout engine in front of N engine actors.

It routes each ``generate`` to the least-loaded live engine, checks every engine's health on a
timer, and replaces an engine that died (its process exited, it was killed) or hung (no answer to a
probe, or work pending with no step taken, for ``health_check_timeout_s``). A replacement is started
in the same placement bundle and resynced to the current weights before it takes requests.

No sample is lost or scored 0: a request in flight on an engine that dies returns a completion with
finish reason ``abort`` (SGLang's convention), so the harness marks the episode ABORTED and the
EpisodeRunner re-queues it. Such requests are counted (``stats["aborted_requests"]``).

Weights go through Ray's object store (``ray.put`` once, every engine reads the same object): the
peak extra memory is one full copy of the weights in the store, on the driver's node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from miles_agent.engine import Completion, FinishReason, PauseMode, SamplingParams
from miles_agent.errors import RunAborted

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0


def actor_failures() -> tuple[type[BaseException], ...]:
    """What a call to a dead or unreachable actor raises (not errors raised by the method itself)."""
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ActorUnavailableError, rex.ObjectLostError)


@dataclass
class _Slot:
    index: int
    actor: Any = None
    ready: bool = False
    inflight: int = 0
    last_steps: int = -1
    last_progress: float = 0.0
    waiting: bool = False  # replaced and alive, but its weights come with the next push (see ``resync``)


class EngineSupervisor:
    """A `RolloutEngine` over engine actors (see module docstring). ``spawn(i)`` starts engine ``i``'s actor."""

    def __init__(self, spawn: Callable[[int], Any], num_engines: int, *, health_check_interval_s: float = 2.0,
                 health_check_timeout_s: float = 10.0, max_restarts: int = 50, weight_version: int = 0) -> None:
        import ray

        self._spawn = spawn
        self.interval, self.timeout, self.max_restarts = health_check_interval_s, health_check_timeout_s, max_restarts
        self._version = weight_version
        self._weights: list[Any] = []  # ObjectRefs of the current version's buckets: restarted engines load them
        self.stats = {"restarts": 0, "aborted_requests": 0}
        self._staging: list[Any] = []  # host buffers reused by every pack of pushed weights
        # Set by a transport that keeps no copy of the weights (rank 0's broadcast): brings a replaced
        # engine to the current weights and returns their version, or None if it must wait for the next push.
        self.resync: Callable[[Any], Awaitable[int | None]] | None = None
        self._fatal: RunAborted | None = None
        self._slots = [_Slot(i, actor=spawn(i)) for i in range(num_engines)]
        ray.get([s.actor.probe.remote() for s in self._slots], timeout=STARTUP_TIMEOUT_S)  # construction errors surface here
        for s in self._slots:
            s.ready = True
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None
        self._closed = False

    # -- the engine contract --------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def actors(self) -> list[Any]:
        return [s.actor for s in self._slots]

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        slot = await self._pick()
        actor = slot.actor
        slot.inflight += 1
        try:
            return await actor.generate.remote(list(input_ids), sampling, return_routed_experts)
        except actor_failures() as e:
            self.stats["aborted_requests"] += 1
            self._failed(slot, actor, f"died under a request ({type(e).__name__})")
            return Completion([], [], FinishReason.ABORT, self._version, prompt_tokens=len(input_ids),
                              meta={"infra_error": f"engine {slot.index} died"})
        finally:
            slot.inflight -= 1

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None:
        await self._each(lambda a: a.pause.remote(mode))

    async def resume(self) -> None:
        await self._each(lambda a: a.resume.remote())

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """One bucket of ``version`` (a transport may send several); see `push_weights`."""
        await self.push_weights(named_tensors, version)

    async def health(self) -> bool:
        return self._fatal is None and not self._closed and any(s.ready for s in self._slots)

    async def shutdown(self) -> None:
        self.kill()

    def kill(self) -> None:
        """Stop supervising and end every engine actor (in-flight requests fail; nothing restarts)."""
        import ray

        self._closed = True
        for t in [self._monitor, *self._tasks]:
            if t is not None:
                t.cancel()
        for s in self._slots:
            if s.actor is not None:
                ray.kill(s.actor, no_restart=True)
            s.ready = False

    # -- weights ----------------------------------------------------------------------------------------
    async def push_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> dict[str, float]:
        """Every live engine loads these tensors as ``version`` (paused in place around the copy).

        Buckets of one version accumulate (a new version starts afresh), and an engine restarting now
        loads all of them before it takes requests."""
        import ray

        from miles_agent.runtime.packed_weights import pack_weights

        packed = pack_weights(named_tensors, self._staging)  # flat numpy buffers: one memcpy into the store
        return await self.push_stored(ray.put(packed), version, packed.nbytes, len(packed.parts))

    async def push_stored(self, ref: Any, version: int, nbytes: int, buckets: int) -> dict[str, float]:
        """`push_weights` for weights already in the object store (``ref``: `PackedWeights`), e.g. put there
        by trainer rank 0 itself, so the driver never copies them."""
        self._bind()
        assert self._lock is not None
        async with self._lock:
            if int(version) != self._version or not self._weights:
                self._weights = []
            self._weights.append(ref)
            self._version = int(version)
            live = [s for s in self._slots if s.ready]
            done = await asyncio.gather(*(self._sync_one(s, s.actor, ref, int(version)) for s in live))
        return {"sync_bytes": float(nbytes), "sync_buckets": float(buckets),
                "sync_engines": float(sum(d is not None for d in done)),
                "engine_memory_resumed": float(sum(bool(d) for d in done)),
                "engine_restarts": float(self.stats["restarts"]),
                "engine_aborted_requests": float(self.stats["aborted_requests"])}

    async def push_with(self, send: Callable[[list[Any]], Awaitable[tuple[dict[str, float], list[Any]]]],
                        version: int, attempts: int = 3) -> dict[str, float]:
        """Weights delivered by someone else (trainer rank 0 over a process group, runtime/rank0_sync.py):
        ``send(live_actors)`` sends them and returns its stats and the object refs a restarted engine loads.
        An engine that dies meanwhile is replaced and the push retried with the engines still alive."""
        self._bind()
        assert self._lock is not None
        async with self._lock:  # restarts wait, then load what this push left
            for attempt in range(attempts):
                live = [s for s in self._slots if s.ready or s.waiting]
                try:
                    stats, refs = await send([s.actor for s in live])
                    break
                except Exception:
                    if attempt == attempts - 1 or not await self._drop_dead(live):
                        raise  # not an engine failure (or too many): the run stops with the cause
            self._weights, self._version = list(refs), int(version)
            for slot in live:
                if slot.waiting and slot.actor is not None:
                    slot.waiting, slot.ready = False, True
        return {**stats, "sync_engines": float(len(live)), "engine_restarts": float(self.stats["restarts"]),
                "engine_aborted_requests": float(self.stats["aborted_requests"])}

    async def _drop_dead(self, slots: list[_Slot]) -> bool:
        """Probe ``slots``; take the ones that do not answer out of rotation (they restart). Any taken out?"""
        probes = await asyncio.gather(*(asyncio.wait_for(_awaitable(s.actor.probe.remote()), self.timeout)
                                        for s in slots), return_exceptions=True)
        dead = [(s, s.actor, p) for s, p in zip(slots, probes) if isinstance(p, BaseException)]
        for slot, actor, error in dead:
            self._failed(slot, actor, f"died during a weight broadcast ({type(error).__name__})")
        return bool(dead)

    async def _sync_one(self, slot: _Slot, actor: Any, ref: Any, version: int) -> bool | None:
        """Whether the engine had released its memory (colocation), or None when it died meanwhile."""
        try:
            return bool(await actor.sync_weights.remote(ref, version))  # resume memory, pause, load, resume
        except actor_failures():
            self._failed(slot, actor, "died during a weight update")
            return None

    def release_memory(self) -> None:
        """Colocation, before the trainer runs: every live engine frees its KV cache (and device weights).
        Blocking on purpose: the trainer must not start before the memory is back."""
        import ray

        live = [(s, s.actor) for s in self._slots if s.ready]
        refs = [a.release_memory.remote() for _, a in live]
        for (slot, actor), ref in zip(live, refs):
            try:
                ray.get(ref, timeout=self.timeout)
            except (*actor_failures(), ray.exceptions.GetTimeoutError):
                self._failed(slot, actor, "failed to release its memory")

    # -- supervision --------------------------------------------------------------------------------
    def _bind(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._loop = asyncio.get_running_loop()
        if self._monitor is None and self.interval > 0:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _pick(self) -> _Slot:
        self._bind()
        while True:
            if self._fatal is not None:
                raise self._fatal
            if self._closed:
                raise RunAborted("the engines were shut down")
            live = [s for s in self._slots if s.ready]
            if live:
                return min(live, key=lambda s: s.inflight)
            await asyncio.sleep(0.05)

    async def _each(self, call: Callable[[Any], Any]) -> None:
        live = [(s, s.actor) for s in self._slots if s.ready]
        results = await asyncio.gather(*(call(a) for _, a in live), return_exceptions=True)
        for (slot, actor), r in zip(live, results):
            if isinstance(r, actor_failures()):
                self._failed(slot, actor, type(r).__name__)
            elif isinstance(r, BaseException):
                raise r

    def _failed(self, slot: _Slot, actor: Any, reason: str) -> None:
        """Take the engine out of rotation and replace it (once, however many callers noticed)."""
        if slot.actor is not actor or not slot.ready or self._closed:
            return
        slot.ready = False
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._spawn_restart, slot, actor, reason)  # callers may be in a thread

    def _spawn_restart(self, slot: _Slot, actor: Any, reason: str) -> None:
        task = self._loop.create_task(self._restart(slot, actor, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, slot: _Slot, dead: Any, reason: str) -> None:
        import ray

        assert self._lock is not None
        while not self._closed:
            self.stats["restarts"] += 1
            log.warning("engine %d %s; restarting it (restart %d of at most %d)", slot.index, reason,
                        self.stats["restarts"], self.max_restarts)
            ray.kill(dead, no_restart=True)
            if self.stats["restarts"] > self.max_restarts:
                self._fatal = RunAborted(f"rollout engines were restarted {self.stats['restarts'] - 1} times, more than "
                                         f"cluster.max_engine_restarts={self.max_restarts}; last: engine {slot.index} "
                                         f"{reason}. Check the engine logs above, then rerun with --resume")
                return
            actor = self._spawn(slot.index)
            try:
                await asyncio.wait_for(actor.probe.remote(), STARTUP_TIMEOUT_S)
                async with self._lock:  # a push in progress finishes first; then load what it pushed
                    if self.resync is not None:
                        await self._resync_from_trainer(slot, actor)
                        return
                    for ref in self._weights:
                        await actor.update_weights.remote(ref, self._version)
                    slot.actor, slot.ready, slot.last_steps = actor, True, -1
                return
            except (TimeoutError, *actor_failures()) as e:
                dead, reason = actor, f"failed to start ({type(e).__name__})"

    async def _resync_from_trainer(self, slot: _Slot, actor: Any) -> None:
        """The replacement gets the weights from the trainer now, or joins the next push if the trainer
        has trained since the last one (or the resync failed: the push then finds out whether it lives)."""
        assert self.resync is not None
        slot.actor, slot.last_steps = actor, -1
        try:
            version = await self.resync(actor)
        except Exception as e:  # noqa: BLE001 - logged; the next push retries this engine
            log.warning("engine %d: resync from the trainer failed (%s); it joins the next push", slot.index, e)
            version = None
        if version is not None and version == self._version:
            slot.ready = True
        else:
            slot.waiting = True

    async def _watch(self) -> None:
        """Probe every live engine each interval; replace the ones that do not answer or do not move."""
        while not self._closed:
            await asyncio.sleep(self.interval)
            live = [(s, s.actor) for s in self._slots if s.ready]
            probes = await asyncio.gather(*(asyncio.wait_for(_awaitable(a.probe.remote()), self.timeout)
                                            for _, a in live), return_exceptions=True)
            now = time.monotonic()
            for (slot, actor), p in zip(live, probes):
                if isinstance(p, BaseException):
                    self._failed(slot, actor, f"did not answer a health probe ({type(p).__name__})")
                elif not p["healthy"]:
                    self._failed(slot, actor, "reports itself unhealthy")
                elif p["steps"] != slot.last_steps or not p["pending"] or p["paused"]:
                    slot.last_steps, slot.last_progress = p["steps"], now
                elif now - slot.last_progress > self.timeout:
                    self._failed(slot, actor, f"made no progress for {self.timeout:g}s with {p['pending']} requests")


async def _awaitable(ref: Any) -> Any:
    return await ref
