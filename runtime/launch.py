"""``cluster.mode=ray``: the trainer group, the engines as actors and their weight transport.

`RayCluster` is the ``ray`` entry point of the ``miles_agent.clusters`` group. The run builds one per
config and calls trainer, engines, transport in order; all three share the cluster's `RaySession` (its
placement group), which the trainer group's ``close`` releases (its ``on_close``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from miles_agent.config import Config
from miles_agent.errors import UserError
from miles_agent.runtime import ray_cluster


@dataclass
class RaySession:
    placement: ray_cluster.Placement
    started_ray: bool
    loopback: bool
    engines: Any = None
    trainer: Any = None
    closed: bool = field(default=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.placement.remove()
        if self.started_ray:
            import ray

            ray.shutdown()


class ObjectStoreTransport:
    """`WeightTransport` to supervised engine actors, the bytes beside Ray's calls.

    With the Ray trainer group, rank 0 sends the weights itself, bucket by bucket (`TrainerActor.put_to_engines`,
    runtime/store_push.py): through shared memory to engines on its node (``shared_memory``), through
    ``ray.put`` otherwise; the driver keeps the handles for engines that restart and never reads the bytes
    (its lazy ``named_weights`` is never read). Otherwise the driver packs what it is given and puts it once."""

    def __init__(self, engines: Any, trainer: Any = None, bucket_bytes: int = 64 << 20, shared_memory: bool = True
                 ) -> None:
        self.engines, self.trainer, self.bucket_bytes = engines, trainer, bucket_bytes
        self.shared_memory = shared_memory  # engines on rank 0's node get the bytes through shared memory

    async def push(self, named_tensors: Any, version: int) -> dict[str, float]:
        if hasattr(self.trainer, "put_to_engines"):
            async def send(actors: list[Any]) -> tuple[dict[str, float], list[Any]]:
                handles, stats = await asyncio.to_thread(self.trainer.put_to_engines, actors, int(version),
                                                         self.bucket_bytes, self.shared_memory)
                return stats, handles

            return await self.engines.push_with(send, version)
        return await self.engines.push_weights(named_tensors, version)


class RayCluster:
    """Trainer ranks and rollout engines as Ray actors in one placement group per run."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.session: RaySession | None = None  # reserved on first use (the trainer is built first)

    @staticmethod
    def check(cfg: Config) -> None:
        """The transport choice, checked before Ray starts or any model loads."""
        if cfg.rollout.engine != "sglang":
            _check_actor_transport(cfg)
        elif cfg.sglang.external_urls or cfg.cluster.colocate or cfg.sync.transport != "distributed":
            from miles_agent.components import transport_builder

            transport_builder(cfg)

    def _session(self) -> RaySession:
        if self.session is None:
            cfg, c = self.cfg, self.cfg.cluster
            started = ray_cluster.connect(c, needed_cpus=(cfg.train.world_size + c.num_engines) * c.cpus_per_actor * 2)
            span = cfg.sglang.tp_size if cfg.rollout.engine == "sglang" and c.colocate else 1  # GPUs per server
            self.session = RaySession(ray_cluster.place(c, cfg.train.world_size, span), started,
                                      loopback=not c.ray_address)
        return self.session

    def trainer(self, model: Any, tokenizer: Any) -> Any:
        from miles_agent import registry
        from miles_agent.components import offload_enabled, trainer_extra
        from miles_agent.runtime.trainer_actor import RayTrainerGroup

        cfg = self.cfg
        offload = offload_enabled(cfg.train.offload, colocate=cfg.cluster.colocate, mode=cfg.cluster.mode)
        backend = registry.load("trainers", cfg.train.backend)
        if offload and not callable(getattr(backend, "offload", None)):
            raise UserError(f"train.offload is on (it is by default with cluster.colocate) but the {cfg.train.backend} "
                            "trainer has no offload() / reload(); set train.offload=false")
        sess = self._session()

        def before_train() -> None:  # colocation: the engines give the device back, then the ranks reload
            if cfg.cluster.colocate and sess.engines is not None:
                sess.engines.release_memory()

        def release_session() -> None:  # after the ranks: the engines, the placement (and Ray, if ours)
            if sess.engines is not None:
                sess.engines.kill()
            sess.close()

        sess.trainer = RayTrainerGroup(model, tokenizer, cfg.train, cfg.algo, temperature=cfg.rollout.temperature,
                                       device=cfg.model.device, options=sess.placement.trainer_options,
                                       loopback=sess.loopback, before_train=before_train, extra=trainer_extra(cfg),
                                       offload=offload, on_close=release_session)
        return sess.trainer

    def engines(self, model: Any, tokenizer: Any) -> list[Any]:
        """Each engine kind has its own actors; SGLang servers given by URL are not placed, only attached."""
        name = self.cfg.rollout.engine
        if name == "sglang" and self.cfg.sglang.external_urls:
            from miles_agent import registry

            return registry.load("engines", name)(self.cfg, model, tokenizer)
        place = {"embedded": self._embedded_actors, "sglang": self._sglang_actors}.get(name)
        if place is None:
            raise UserError(f"rollout.engine={name} has no Ray actors; under cluster.mode=ray use rollout.engine="
                            "embedded or sglang, or run it with cluster.mode=inprocess")
        return place(model, tokenizer)

    def _embedded_actors(self, model: Any, tokenizer: Any) -> list[Any]:
        """Embedded engines as actors under one supervisor that restarts them (episodes see one engine)."""
        import ray

        from miles_agent.runtime.engine_actor import remote_engine_class
        from miles_agent.runtime.supervisor import EngineSupervisor

        cfg, sess = self.cfg, self._session()
        cls = remote_engine_class()
        model_ref, tok_ref = ray.put(model.to("cpu")), ray.put(tokenizer)
        r, c = cfg.rollout, cfg.cluster

        def spawn(i: int) -> Any:
            return cls.options(**sess.placement.engine_options(i)).remote(
                model_ref, tok_ref, r.max_batch_size, cfg.model.device, true_on_policy=cfg.algo.true_on_policy,
                prefix_cache_bytes=r.prefix_cache_mb << 20)

        sess.engines = EngineSupervisor(spawn, c.num_engines, health_check_interval_s=c.health_check_interval_s,
                                        health_check_timeout_s=c.health_check_timeout_s,
                                        max_restarts=c.max_engine_restarts)
        return [sess.engines]

    def _sglang_actors(self, model: Any, tokenizer: Any) -> list[Any]:
        from miles_agent.runtime.sglang_actor import build_sglang_actor_engines

        return build_sglang_actor_engines(self.cfg, model, tokenizer, self._session())  # a server per bundle

    def transport(self, trainer: Any, engines: list[Any]) -> Any:
        if self.cfg.rollout.engine == "sglang":
            return self._sglang_transport(trainer, engines)
        return self._actor_transport(trainer, engines)

    def _actor_transport(self, trainer: Any, engines: list[Any]) -> Any:
        """object-store (``auto``): through Ray's object store, via the driver. distributed: trainer rank 0
        broadcasts to the engine actors itself (runtime/rank0_sync.py)."""
        if _check_actor_transport(self.cfg) == "object-store":
            return ObjectStoreTransport(engines[0], trainer, bucket_bytes=self.cfg.sync.bucket_mb << 20,
                                        shared_memory=self.cfg.sync.shared_memory)
        from miles_agent.runtime.rank0_sync import RankZeroTransport

        return RankZeroTransport(trainer, engines[0], self.rank0_options())

    def _sglang_transport(self, trainer: Any, engines: list[Any]) -> Any:
        """SGLang servers take the in-process transports over HTTP; launched as actors, rank 0 broadcasts to
        them itself (distributed), and colocated ones get their memory back inside the push's pause."""
        from miles_agent.components import build_transport

        cfg = self.cfg
        if cfg.sglang.external_urls:
            return build_transport(cfg, engines)
        if not cfg.cluster.colocate and cfg.sync.transport == "distributed":  # the driver holds nothing
            from miles_agent.runtime.rank0_sync import SGLangRankZeroTransport

            return SGLangRankZeroTransport(trainer, [e.url for e in engines], self.rank0_options())
        if cfg.cluster.colocate:
            from miles_agent.runtime.sglang_colocate import GatherFirst, memory_phased

            return GatherFirst(build_transport(cfg, memory_phased(engines, cfg.sglang.control_timeout_s)))
        return build_transport(cfg, engines)

    def rank0_options(self) -> dict[str, Any]:
        """`Rank0Broadcaster`'s arguments from the ``sync`` section (checked here, in the driver)."""
        cfg, sync = self.cfg, self.cfg.sync
        if sync.bucket_mb < 1:
            raise UserError(f"sync.bucket_mb must be >= 1, got {sync.bucket_mb}")
        device = cfg.model.device
        backend = sync.backend if sync.backend != "auto" else ("nccl" if device.startswith("cuda") else "gloo")
        if backend not in ("gloo", "nccl"):
            raise UserError(f"sync.backend must be gloo, nccl or auto, got {sync.backend!r}")
        return dict(backend=backend, master_address=_rank0_address(sync.master_address, self._session().loopback),
                    bucket_bytes=sync.bucket_mb << 20, check=sync.check,
                    strip_prefix=sync.strip_prefix, add_prefix=sync.add_prefix,
                    control_timeout_s=cfg.sglang.control_timeout_s)


def _check_actor_transport(cfg: Config) -> str:
    """``object-store`` or ``distributed``: the transports that reach supervised engine actors."""
    sync = cfg.sync
    if sync.transport in ("auto", "object-store"):
        return "object-store"
    if sync.transport != "distributed":
        raise UserError(f"cluster.mode=ray sends weights through Ray's object store (sync.transport=object-store, "
                        f"the default) or from trainer rank 0 over a process group (sync.transport=distributed); "
                        f"sync.transport={sync.transport} is for cluster.mode=inprocess")
    if cfg.cluster.colocate:
        raise UserError("sync.transport=distributed cannot reach colocated engines: they share their trainer "
                        "rank's GPU and NCCL cannot connect two processes on one device; leave "
                        "sync.transport=object-store (the default) or set cluster.colocate=false")
    return "distributed"


def _rank0_address(configured: str, loopback: bool) -> str:
    """Where the engines meet rank 0: loopback when Ray runs on this machine only, else rank 0's node
    (the configured loopback default cannot be reached from other nodes)."""
    if loopback or configured not in ("127.0.0.1", "localhost"):
        return configured
    return ""  # rank 0 fills in its node's address
