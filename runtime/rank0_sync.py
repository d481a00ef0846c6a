"""Weight sync under Ray from trainer rank 0 straight to the engine actors (``cluster.mode=ray`` with
``sync.transport=distributed``): NCCL on GPU, gloo on CPU, over SGLang's weight-update calls
(``init_weights_update_group`` / ``update_weights_from_distributed``), as slime and miles do.

The default Ray path (`launch.ObjectStoreTransport`) has rank 0 ``ray.put`` the gathered weights and
every engine read them from the object store; here they go over a process group instead (NCCL between
GPUs), and the driver never holds a byte of them either way. At each push it hands rank 0 the handles of the live
engine actors; every rank gathers its full tensors (a collective) while rank 0 broadcasts them bucket by
bucket to a weight-update group it forms with those engines -- and re-forms when the set changes (an
engine was restarted) or a broadcast broke.

No copy of the weights is kept for engines that restart: the `EngineSupervisor` asks rank 0 to send
its weights to the replacement over a group of their own, which it does at once if no train step has
changed them since the last push (the version is then exact); otherwise the replacement waits out of
rotation and joins the next push (at most one train step later). Every call reaches all trainer ranks
in the same order (`RayTrainerGroup` submits under a lock), so a resync from the event loop and a train
step from its worker thread never cross inside a collective. An engine that dies during a broadcast
is replaced, and the push is retried with the engines still alive.

Colocated engines (``cluster.colocate``) share their trainer rank's GPU, and NCCL cannot connect two
processes on one device: they keep the default path (`launch.build_transport` says so).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from miles_agent.transports.groups import DEFAULT_GROUP


class ActorReceiver:
    """A `WeightReceiver` over an `EngineActor` handle: each call is the actor method of the same name."""

    # The transport may announce a push's last bucket with ``resume=True``: the actor then resumes generation
    # once that bucket and every earlier one have loaded, so `continue_generation` needs no call of its own (one
    # Ray round trip fewer after the transfer). If that announcement fails, `continue_generation` calls.
    resumes_after_last_bucket = True
    receives_streams = True  # the actor's receiver takes a whole push in one call (transports/stream.py)

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._buckets: dict[str, int] = {}  # per group: buckets announced since it formed (the actor's turn order)
        self._pause: str | None = None  # a pause the next announcement carries
        self._resumed = False  # the push's last announcement resumed the actor: continue_generation has nothing to do

    async def pause_generation(self, mode: str = "in_place") -> None:
        """Carried by the next bucket's announcement instead of a call of its own: the actor pauses before that
        bucket touches a weight (and every later bucket waits for its turn), one Ray round trip fewer a push."""
        self._pause = mode
        self._resumed = False

    async def continue_generation(self) -> None:
        self._pause = None
        if self._resumed:
            self._resumed = False
            return
        await self.actor.continue_generation.remote()

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> None:
        await self.actor.init_weights_update_group.remote(master_address, master_port, rank_offset, world_size,
                                                          group_name, backend)
        self._buckets[group_name] = 0

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None, resume: bool = False) -> None:
        bucket = self._buckets.get(group_name, 0)  # numbered when announced, before the call is awaited
        self._buckets[group_name] = bucket + 1
        pause, self._pause = self._pause, None
        await self.actor.update_weights_from_distributed.remote(names, dtypes, shapes, group_name, flush_cache,
                                                                weight_version, load_format, bucket, pause, resume)
        self._resumed = resume

    async def receive_weights_stream(self, group_name: str = DEFAULT_GROUP, weight_version: str | None = None,
                                     resume: bool = False) -> None:
        """A whole push in one actor call; carries the pause before it and, with ``resume``, the continue after."""
        pause, self._pause = self._pause, None
        await self.actor.receive_weights_stream.remote(group_name, weight_version, pause, resume)
        self._resumed = resume

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self.actor.destroy_weights_update_group.remote(group_name)

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        return await self.actor.check_weights.remote(action)


class Rank0Broadcaster:
    """Held by trainer rank 0: the weight-update group with the current engine actors, and the push."""

    def __init__(self, *, backend: str, master_address: str, bucket_bytes: int, check: bool,
                 strip_prefix: str = "", add_prefix: str = "", control_timeout_s: float = 600.0,
                 stream: bool | None = None) -> None:
        # Plain values only (no name-map function): the trainer actor compares the options of each push
        # with the last ones to know whether to rebuild this broadcaster.
        from miles_agent.transports.core import prefix_map

        if not master_address:  # a multi-node cluster: the engines meet rank 0 on its node's address
            import ray

            master_address = ray.util.get_node_ip_address()
        self.options = dict(backend=backend, master_address=master_address, bucket_bytes=bucket_bytes,
                            check=check, name_map=prefix_map(strip_prefix, add_prefix), stream=stream)
        self.control_timeout_s = control_timeout_s
        self.transport: Any = None
        self._members: list[str] = []
        self._formed = 0
        self._loop = asyncio.new_event_loop()  # one loop for every push: HTTP sessions and threads are reused
        self._clients: dict[str, Any] = {}

    def push(self, named_weights: Iterator[tuple[str, Any]], engines: list[Any], version: int) -> dict[str, float]:
        """Broadcast ``named_weights`` to ``engines`` (engine actor handles, or SGLang server URLs) as
        ``version``; returns the stats. ``named_weights`` is a collective: it is always read to the end,
        even when the broadcast fails, so the other trainer ranks are never left waiting in a gather."""
        try:
            return self._loop.run_until_complete(self._broadcast(named_weights, engines, version)) if engines else {}
        finally:
            for _ in named_weights:  # drain: the rest of the gather still has to happen on every rank
                pass

    def send_once(self, named_weights: Iterator[tuple[str, Any]], engines: list[Any], version: int) -> None:
        """Bring replaced engines to ``version`` over a group of their own, formed and left for this one
        send (the next push forms the main group again with them in it). Reads ``named_weights`` to the end."""
        from miles_agent.transports.dist import DistributedTransport

        self._formed += 1
        transport = DistributedTransport([self._receiver(e) for e in engines], **self.options,
                                         group_name=f"{DEFAULT_GROUP}-rank0-{self._formed}")

        async def send() -> None:
            try:
                await transport.push(named_weights, version)
            finally:
                await _close(transport)

        try:
            self._loop.run_until_complete(send())
        finally:
            for _ in named_weights:
                pass

    async def _broadcast(self, tensors: Iterator[tuple[str, Any]], engines: list[Any], version: int
                         ) -> dict[str, float]:
        from miles_agent.transports.dist import DistributedTransport

        if [_key(e) for e in engines] != self._members:
            await self._leave()  # an engine was replaced: the group is formed again with the live ones
        if self.transport is None:
            self._formed += 1  # a fresh name: a group a dead member never left still holds the old one
            self.transport = DistributedTransport([self._receiver(e) for e in engines], **self.options,
                                                  group_name=f"{DEFAULT_GROUP}-rank0-{self._formed}")
            self._members = [_key(e) for e in engines]
        return await self.transport.push(tensors, version)

    def _receiver(self, engine: Any) -> Any:
        if not isinstance(engine, str):
            return ActorReceiver(engine)
        if engine not in self._clients:  # an SGLang server: its HTTP weight-update endpoints
            from miles_agent.engines.sglang.client import SGLangEngine

            self._clients[engine] = SGLangEngine(engine, control_timeout_s=self.control_timeout_s)
        return self._clients[engine]

    def close(self) -> None:
        """Leave the weight-update group (best effort) and stop the loop."""
        self._loop.run_until_complete(self._leave())
        self._loop.close()

    async def _leave(self) -> None:

        transport, self.transport, self._members = self.transport, None, []
        if transport is not None:
            await _close(transport)


async def _close(transport: Any) -> None:
    """Leave a weight-update group; a dead member cannot leave, so our side is destroyed regardless."""
    from miles_agent.transports.groups import destroy_group

    own = transport.group
    try:
        await transport.close()
    except Exception:  # noqa: BLE001 - the survivors' side goes with the next group
        if own is not None:
            destroy_group(own)


def _key(engine: Any) -> str:
    return engine if isinstance(engine, str) else engine._actor_id.hex()


class RankZeroTransport:
    """The driver's `WeightTransport` for this path: asks the trainer ranks to push (module docstring)."""

    kind = "distributed-from-rank-0"

    def __init__(self, trainer: Any, supervisor: Any, options: dict[str, Any]) -> None:
        self.trainer, self.supervisor, self.options = trainer, supervisor, options
        supervisor.resync = self.resync  # replaced engines get their weights from rank 0 (module docstring)

    async def push(self, named_tensors: Any, version: int) -> dict[str, float]:
        # ``named_tensors`` is deliberately not read: the trainer group gathers lazily, so the driver
        # never pulls the weights; rank 0 sends them itself.
        async def send(actors: list[Any]) -> tuple[dict[str, float], list[Any]]:
            return await asyncio.to_thread(self.trainer.broadcast_weights, actors, int(version), self.options), []

        return await self.supervisor.push_with(send, version)

    async def resync(self, actor: Any) -> int | None:
        return await asyncio.to_thread(self.trainer.resync, [actor], self.options)


class SGLangRankZeroTransport:
    """The same path to SGLang servers launched under Ray (disaggregated): rank 0 reaches each server's
    weight-update endpoints over HTTP and broadcasts to them. A restarted server reloads its launch
    checkpoint; the next push brings it to the current version."""

    kind = "distributed-from-rank-0"

    def __init__(self, trainer: Any, urls: list[str], options: dict[str, Any]) -> None:
        self.trainer, self.urls, self.options = trainer, list(urls), options

    async def push(self, named_tensors: Any, version: int) -> dict[str, float]:
        stats = await asyncio.to_thread(self.trainer.broadcast_weights, self.urls, int(version), self.options)
        return {**stats, "sync_engines": float(len(self.urls))}
