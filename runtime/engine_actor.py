"""A rollout engine as a Ray actor: the embedded EmbeddedEngine in its own process, behind the same calls.

The actor is async (Ray runs its methods on one event loop), so many ``generate`` calls are in
flight at once and the engine batches them exactly as it does in-process. Besides the engine
contract it answers ``probe`` (liveness plus progress, for the supervisor's hang detection),
``release_memory`` / ``resume_memory`` (colocation: the KV cache is dropped and CUDA weights are
moved to host while the trainer uses the device) and two fault-injection calls used by tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

from miles_agent.engine import Completion, PauseMode, SamplingParams


class EngineActor:
    """Wrapped with ``ray.remote`` by ``remote_engine_class``; plain class so it stays importable without Ray."""

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int, device: str, weight_version: int = 0,
                 true_on_policy: bool = False, prefix_cache_bytes: int = 1 << 30) -> None:
        import torch

        from miles_agent.engines.embedded.engine import EmbeddedEngine
        from miles_agent.transports.receiver import InProcessReceiver

        torch.set_num_threads(1)  # tiny CPU engines share cores with the trainer ranks
        self.device = device
        self.engine = EmbeddedEngine(model, tokenizer, max_batch_size=max_batch_size, device=device,
                                  weight_version=weight_version, true_on_policy=true_on_policy,
                                  prefix_cache_bytes=prefix_cache_bytes)
        self.released = False
        self.memory_events: list[tuple[str, float]] = []  # colocation: when the memory went and came back
        self._parts: dict[str, Any] | None = None  # the push whose buckets are arriving (`sync_weights_part`)
        self._written_waiter: Any = None  # made on the first announced push (runtime/shared_weights.py)
        self.receiver = InProcessReceiver(self.engine)  # SGLang's weight-update API over this engine

    async def generate(self, input_ids: list[int], sampling: SamplingParams,
                       return_routed_experts: bool = False) -> Completion:
        return await self.engine.generate(input_ids, sampling, return_routed_experts=return_routed_experts)

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, weights: Any, version: int) -> int:
        """``weights``: `PackedWeights` or `SharedWeights` (what the trainer and the supervisor send) or a list
        of (name, tensor)."""
        from miles_agent.runtime.packed_weights import named_tensors
        from miles_agent.runtime.shared_weights import SharedWeights

        await self.engine.update_weights(named_tensors(weights), version)
        if isinstance(weights, SharedWeights):
            weights.check()  # the trainer did not start overwriting them while they were copied
        return self.engine.weight_version

    async def sync_weights(self, weights: Any, version: int) -> bool:
        """The supervisor's whole per-engine push in one actor call (one round trip, not four): weights back
        on the device, pause in place, load ``weights`` as ``version``, resume. Returns whether the memory
        had been released (colocation). A failed load leaves the engine paused, as the separate calls did."""
        was_released = await self.resume_memory()
        await self.pause(PauseMode.IN_PLACE)
        await self.update_weights(weights, version)
        await self.resume()
        return was_released

    async def sync_weights_part(self, weights: Any, version: int, push: str, part: int, parts: int,
                                announced: bool = False) -> bool:
        """Bucket ``part`` of one push (id ``push``) that the trainer sends one bucket at a time
        (runtime/store_push.py). ``parts``: how many the push has, or 0 when the trainer tells it later
        (`sync_weights_done`). Ray may start these calls in any order: the first to come resumes the memory
        and pauses in place, the others wait for that; each loads its bucket; once all have loaded,
        generation resumes. ``announced``: ``weights`` is a `SharedWeights` sent before rank 0 wrote its
        bytes: wait for them; if rank 0 laid the push out otherwise, load nothing from this call (the push's
        real parts follow). Returns whether the memory had been released (only the call that paused can
        say). A failed load leaves the engine paused, as `sync_weights` does."""
        state = self._push_state(push)
        first = state["ready"] is None
        if first:
            ready = state["ready"] = asyncio.get_running_loop().create_future()
            try:
                state["released"] = await self.resume_memory()
                await self.pause(PauseMode.IN_PLACE)
                ready.set_result(None)
            except BaseException as e:
                ready.set_exception(e)
                ready.exception()  # retrieved: the waiting calls raise it
                raise
        else:
            await asyncio.shield(state["ready"])
        if announced:
            if not await self._load_announced(weights, version):
                return first and state["released"]
        else:
            await self.update_weights(weights, version)
        state["loaded"] += 1
        await self._finish_push(state, parts)
        return first and state["released"]

    async def _load_announced(self, weights: Any, version: int) -> bool:
        """Load an announced `SharedWeights` once rank 0 has written it: the views and the name checks are
        made now, and the loading thread itself waits for the bytes (woken by rank 0), so the copy starts the
        moment they are in place. False when that push was laid out otherwise (nothing loaded)."""
        from miles_agent.runtime.shared_weights import WrittenWaiter

        if self._written_waiter is None:  # woken by actor id: rank 0 knows its engines' (outside Ray: by pid)
            ray = sys.modules.get("ray")  # imported in any actor; outside one (tests) it stays unimported
            in_actor = ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id()
            self._written_waiter = WrittenWaiter(in_actor or f"pid-{os.getpid()}")
        waiter = self._written_waiter
        if not await self.engine.update_weights(weights.views(), version, ready=lambda: waiter.wait(weights)):
            return False
        weights.check()  # the trainer did not start overwriting them while they were copied
        return True

    async def sync_weights_abandoned(self, push: str) -> None:
        """Rank 0 could not write the push ``push`` it had announced (its gather failed): nothing of it has
        loaded, so generation goes on with the weights the engine has."""
        state = self._parts
        if state is None or state["push"] != push or state["ready"] is None:
            return
        with contextlib.suppress(Exception):  # the pause failed: the announced call reports that
            await asyncio.shield(state["ready"])
        if self._parts is state and state["loaded"] == 0:
            self._parts = None
            await self.resume()

    async def sync_weights_done(self, push: str, parts: int) -> None:
        """The push ``push`` has ``parts`` buckets: generation resumes once they have all loaded (now, if they
        have)."""
        await self._finish_push(self._push_state(push), parts)

    def _push_state(self, push: str) -> dict[str, Any]:
        if self._parts is None or self._parts["push"] != push:  # a new push (a retried one has a new id)
            self._parts = {"push": push, "ready": None, "loaded": 0, "parts": 0, "released": False}
        return self._parts

    async def _finish_push(self, state: dict[str, Any], parts: int) -> None:
        state["parts"] = parts or state["parts"]
        if state["parts"] and state["loaded"] == state["parts"] and self._parts is state:
            self._parts = None
            await self.resume()

    # -- SGLang's weight-update calls, so trainer rank 0 can broadcast to this engine (runtime/rank0_sync.py)
    async def pause_generation(self, mode: str = "in_place") -> None:
        await self.receiver.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.receiver.continue_generation()

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        await self.receiver.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                      group_name, backend)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, flush_cache: bool, weight_version: str | None,
                                              load_format: str | None, bucket: int | None = None,
                                              pause: str | None = None, resume: bool = False) -> None:
        """``bucket``: the announcement's number in its group. Ray starts an async actor's calls in no
        guaranteed order, so the receiver takes the buckets in this order, not in the order they started.
        ``pause``: pause generation (that mode) first -- the push's pause, carried by its first announcement;
        later buckets wait for this one's turn, so none touches a weight before it.
        ``resume``: this is the push's last bucket: once it and every earlier one have loaded, resume generation
        (the push's continue, carried by its last announcement). Not when this bucket fails."""
        if pause is not None:
            await self.receiver.pause_generation(pause)
        await self.receiver.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache,
                                                            weight_version, load_format, bucket=bucket)
        if resume:
            await self.receiver.settled()
            await self.receiver.continue_generation()

    async def receive_weights_stream(self, group_name: str, weight_version: str | None, pause: str | None = None,
                                     resume: bool = False) -> None:
        """A whole distributed push in one call (transports/stream.py). ``pause``: pause generation (that
        mode) first; ``resume``: resume it once every bucket has loaded (not when the push fails)."""
        if pause is not None:
            await self.receiver.pause_generation(pause)
        await self.receiver.receive_weights_stream(group_name, weight_version)
        if resume:
            await self.receiver.continue_generation()

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.receiver.destroy_weights_update_group(group_name)

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        return await self.receiver.check_weights(action)

    async def probe(self) -> dict[str, Any]:
        """Alive, weight version, requests waiting or running, and decode/prefill steps taken so far:
        work pending with no step taken between two probes means the engine is stuck."""
        e = self.engine
        return {"healthy": await e.health(), "weight_version": e.weight_version,
                "pending": len(e._waiting) + len(e._running), "paused": e._paused,
                "steps": e.stats["decode_steps"] + e.stats["prefill_batches"] + e.stats["failed_steps"],
                "kv_cache_bytes": _nbytes(e.runner.k_cache) + _nbytes(e.runner.v_cache),
                "prefix_cache_bytes": e.cache.nbytes(), "prefix_cache_hit_rate": e.cache_hit_rate,
                "released": self.released}

    async def release_memory(self) -> None:
        """Colocation: stop, retract running requests (their KV cache goes), free the cache, weights to host."""
        await self.engine.pause(PauseMode.RETRACT)
        self.engine.runner.release()
        self.engine.cache.clear()  # the prefix cache's KV is device memory too
        if self.engine.device.type == "cuda":
            import torch

            self.engine.runner.model.to("cpu")
            torch.cuda.empty_cache()
        self.released = True
        self.memory_events.append(("release", time.monotonic()))

    async def resume_memory(self) -> bool:
        """Weights back on the device (decoding continues at the next ``resume``); returns whether
        the memory had been released."""
        was = self.released
        if was and self.engine.device.type == "cuda":
            self.engine.runner.model.to(self.engine.device)
        if was:
            self.memory_events.append(("resume", time.monotonic()))
        self.released = False
        return was

    def memory_log(self) -> list[tuple[str, float]]:
        """(``release`` or ``resume``, monotonic time) for each time the memory was given back or taken again."""
        return list(self.memory_events)

    async def shutdown(self) -> None:
        if self._written_waiter is not None:
            self._written_waiter.close()
        await self.engine.shutdown()

    def node_id(self) -> str:
        """The Ray node this engine runs on (whether it can map trainer rank 0's shared memory)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def where(self) -> dict[str, Any]:
        from miles_agent.runtime.ray_cluster import where_am_i

        return where_am_i()

    # -- fault injection (tests, chaos drills) --------------------------------------------------------
    def crash(self) -> None:
        """Die at once, as a segfault or OOM kill would."""
        os._exit(1)

    async def hang(self, seconds: float) -> None:
        """Block the actor's event loop (a stuck engine): probes time out, requests stop moving."""
        time.sleep(seconds)


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def remote_engine_class() -> Any:
    import ray

    return ray.remote(max_restarts=0, max_concurrency=1000)(EngineActor)
