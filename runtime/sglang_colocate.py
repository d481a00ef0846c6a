"""SGLang servers colocated with Ray trainer ranks: the memory phases around each train step.

Server ``i`` runs in trainer rank ``i``'s placement bundle (a fractional GPU on the same device),
launched with ``--enable-memory-saver`` so SGLang can really unmap its memory. Per step:

1. before the train step (`release`, driven by the trainer group's ``before_train`` hook):
   ``/pause_generation`` mode ``retract`` (requests in flight go back to the queue and wait; their KV
   cache is dropped), then ``/release_memory_occupation`` for the weights, the KV cache and the CUDA
   graphs. The trainer ranks reload only after every server has answered.
2. the weight push: first the trainer ranks gather the weights and offload (`GatherFirst`); then,
   inside the transport's pause (`MemoryPhasedReceiver`): after ``/pause_generation``,
   ``/resume_memory_occupation`` ``["weights"]``; the transport loads the new weights; then
   ``["kv_cache", "cuda_graph"]``, then ``/continue_generation``. This is SGLang's intended order (and
   slime's): the weights' pages come back with undefined contents unless the server keeps a CPU backup,
   so they are written before anything reads them, and the KV cache is mapped only once the weight
   update's buffers are gone. The server stays paused throughout, so nothing runs on unmapped memory.

The HTTP calls are made by each server's actor (its keeper, on its node), which remembers what it
released: a push without a release before it (the first one after ``--resume``) resumes nothing.
"""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

RELEASE_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang GPU_MEMORY_TYPE_*; older servers ignore cuda_graph
WEIGHT_TAGS = ("weights",)
CACHE_TAGS = ("kv_cache", "cuda_graph")
MEMORY_SAVER_ARGS = {"enable_memory_saver": True}  # --enable-memory-saver: release really frees the device


def post(url: str, path: str, payload: Any, timeout_s: float) -> Any:
    """One control request to a server; a non-200 raises naming the server's answer."""
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = r.read().decode()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"SGLang server {url}{path} answered HTTP {e.code}: "
                           f"{e.read().decode(errors='replace')[:500]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"SGLang server {url}{path} is unreachable ({e})") from None
    return json.loads(body) if body else None


class ServerMemory:
    """The actor-side half: release and resume one server's memory, remembering what is released."""

    def __init__(self, server: Any, url: str) -> None:
        self.server, self.url = server, url
        self.released: set[str] = set()

    def release(self, timeout_s: float) -> list[str]:
        if self.server.ensure_running(timeout_s):  # it died: a fresh one (it loads the weights at the push)
            self.released.clear()
        post(self.url, "/pause_generation", {"mode": "retract"}, timeout_s)
        post(self.url, "/release_memory_occupation", {"tags": list(RELEASE_TAGS)}, timeout_s)
        self.released = set(RELEASE_TAGS)
        return sorted(self.released)

    def resume(self, tags: list[str], timeout_s: float) -> list[str]:
        if self.server.ensure_running(timeout_s):
            self.released.clear()  # a restarted server holds all its memory again
        todo = [t for t in tags if t in self.released]
        if todo:
            post(self.url, "/resume_memory_occupation", {"tags": todo}, timeout_s)
            self.released -= set(todo)
        return todo


class MemoryPhasedReceiver:
    """An `SGLangEngine` as the weight transport sees it, with the memory resumed inside the push's
    pause (see the module docstring). Every other receiver call goes to the engine unchanged."""

    def __init__(self, engine: Any, actor: Any, timeout_s: float) -> None:
        self.engine, self.actor, self.timeout_s = engine, actor, timeout_s

    async def _resume(self, tags: tuple[str, ...]) -> None:
        import ray

        from miles_agent.transports.core import WeightSyncError

        try:
            await self.actor.resume_memory.remote(list(tags), self.timeout_s)
        except ray.exceptions.RayTaskError as e:  # the server's answer, not Ray's traceback
            raise WeightSyncError(f"resuming {list(tags)} on {self.engine.url}: {e.cause}") from None

    async def pause_generation(self, mode: str = "in_place") -> None:
        await self.engine.pause_generation(mode)
        await self._resume(WEIGHT_TAGS)

    async def continue_generation(self) -> None:
        await self._resume(CACHE_TAGS)
        await self.engine.continue_generation()

    # -- unchanged ---------------------------------------------------------------------------------
    async def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> None:
        await self.engine.update_weights_from_tensor(*args, **kwargs)

    async def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        await self.engine.init_weights_update_group(*args, **kwargs)

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> None:
        await self.engine.update_weights_from_distributed(*args, **kwargs)

    async def destroy_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        await self.engine.destroy_weights_update_group(*args, **kwargs)

    async def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> None:
        await self.engine.update_weights_from_disk(*args, **kwargs)

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        return await self.engine.check_weights(action)

    def __getattr__(self, name: str) -> Any:  # url, weight_version, ... for logs and metrics
        return getattr(self.engine, name)


def memory_phased(engines: list[Any], timeout_s: float) -> list[Any]:
    """The transport's view of colocated server clients (each owns an `ActorServer` process)."""
    return [MemoryPhasedReceiver(e, e.process.actor, timeout_s) for e in engines]


class GatherFirst:
    """A weight transport that reads the first tensor before the inner one starts: the trainer group
    gathers lazily, and its ranks must gather and free the device before the servers take it back."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def push(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> dict[str, float]:
        tensors = iter(named_tensors)
        first = next(tensors, None)  # the gather (a collective on every rank), then the ranks offload
        return await self.inner.push(itertools.chain([first] if first is not None else [], tensors), version)

    def __getattr__(self, name: str) -> Any:  # close, kind, ...
        return getattr(self.inner, name)
