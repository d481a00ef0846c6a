"""Ray on one machine or a cluster: connect, then place trainer ranks and engines in placement groups.

Topology (``cluster`` config section, ``train.world_size`` trainer ranks):

* disaggregated (``colocate: false``): one bundle per trainer rank ``{CPU, GPU: trainer_gpus}`` and one
  per engine ``{CPU, GPU: gpus_per_engine}``, in one placement group, so trainer and engines never
  share a device.
* colocated (``colocate: true``): one bundle per trainer rank; engine ``i`` shares bundle ``i`` with
  trainer rank ``i`` (fractional GPUs), and releases its memory while the trainer trains. An engine that
  spans ``span`` GPUs (an SGLang server with ``tp_size`` > 1) sits in bundle ``i * span`` and uses the GPUs
  of ranks ``i * span .. (i + 1) * span - 1`` (runtime/sglang_actor.py points its server at them).

Without ``ray_address`` Ray starts on this machine, loopback only, without a dashboard; with one
(``auto`` or ``host:port``) the driver joins that cluster. When the caller already initialised Ray
(tests, notebooks), that session is used as is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from miles_agent.config import ClusterConfig
from miles_agent.errors import UserError, require

PLACEMENT_TIMEOUT_S = 60.0


def ray_module() -> Any:
    return require("ray", "ray", "cluster.mode=ray")


def connect(cluster: ClusterConfig, needed_cpus: float) -> bool:
    """Initialise Ray unless it already is; returns whether this call started it."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # workers use this interpreter as is
    if not cluster.ray_address:
        loopback_only()
    ray = ray_module()
    if ray.is_initialized():
        return False
    if cluster.ray_address:
        try:
            ray.init(address=cluster.ray_address, log_to_driver=True)
        except ConnectionError as e:
            raise UserError(f"cannot reach the Ray cluster at --ray-address {cluster.ray_address} ({e}); start it "
                            "with `ray start --head` or drop --ray-address to run on this machine") from None
        return True
    # Actors reserve logical CPUs for placement; a laptop with 2 cores still runs 4 tiny actors.
    ray.init(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, math.ceil(needed_cpus)),
             log_to_driver=True)
    return True


def loopback_only() -> None:
    """A Ray started here serves on 127.0.0.1 only. Ray otherwise swaps 127.0.0.1 for the routable
    address and listens on every interface; with this switch (read when ray is first imported, and
    inherited by its workers) the node address is loopback and its servers bind to it."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@dataclass
class Placement:
    """Where each actor goes: bundle indices into one placement group."""

    group: Any  # ray.util.placement_group.PlacementGroup
    trainer_bundles: list[int]
    engine_bundles: list[int]
    trainer_gpus: float
    engine_gpus: float
    cpus: float
    engine_span: int = 1  # colocated: trainer ranks (bundles) one engine covers, from its own bundle on

    def options(self, bundle: int, gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.cpus, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=bundle)}

    def trainer_options(self, rank: int) -> dict[str, Any]:
        return self.options(self.trainer_bundles[rank], self.trainer_gpus)

    def engine_options(self, index: int) -> dict[str, Any]:
        return self.options(self.engine_bundles[index], self.engine_gpus)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def bundle_specs(cluster: ClusterConfig, world_size: int, engine_span: int = 1
                 ) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """(bundles, trainer rank -> bundle, engine -> bundle) for the configured topology; pure, so testable.
    ``engine_span``: GPUs one colocated engine covers (its first bundle is the one it is placed in)."""
    c = cluster
    if c.num_engines < 1:
        raise UserError(f"cluster.num_engines must be >= 1, got {c.num_engines}")
    if c.gpus_per_engine < 0 or c.trainer_gpus < 0:
        raise UserError("cluster.gpus_per_engine and cluster.trainer_gpus must be >= 0")

    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}

    if c.colocate:
        if c.num_engines * engine_span > world_size:
            raise UserError(f"cluster.colocate puts each engine beside {engine_span} trainer rank(s): num_engines="
                            f"{c.num_engines} needs train.world_size >= {c.num_engines * engine_span} "
                            "(or set cluster.colocate=false)")
        share = c.trainer_gpus + c.gpus_per_engine
        if share > 1:
            raise UserError(f"colocated trainer_gpus + gpus_per_engine = {share:g} must fit one device (<= 1), "
                            "e.g. cluster.trainer_gpus=0.5 cluster.gpus_per_engine=0.5")
        bundles = [bundle(2 * c.cpus_per_actor, math.ceil(share)) for _ in range(world_size)]
        return bundles, list(range(world_size)), [i * engine_span for i in range(c.num_engines)]
    bundles = [bundle(c.cpus_per_actor, c.trainer_gpus) for _ in range(world_size)]
    bundles += [bundle(c.cpus_per_actor, c.gpus_per_engine) for _ in range(c.num_engines)]
    return bundles, list(range(world_size)), list(range(world_size, world_size + c.num_engines))


def place(cluster: ClusterConfig, world_size: int, engine_span: int = 1) -> Placement:
    """Reserve the bundles (PACK: one node when it fits) and wait until Ray grants them."""
    ray = ray_module()
    from ray.util.placement_group import placement_group

    bundles, trainer_b, engine_b = bundle_specs(cluster, world_size, engine_span)
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
        raise UserError(f"Ray could not place {len(bundles)} bundles ({need['CPU']:g} CPUs, {need['GPU']:g} GPUs) "
                        f"within {PLACEMENT_TIMEOUT_S:.0f}s; the cluster has {ray.available_resources()}. "
                        "Lower train.world_size / cluster.num_engines / GPU shares, or add nodes")
    return Placement(group, trainer_b, engine_b, cluster.trainer_gpus, cluster.gpus_per_engine,
                     cluster.cpus_per_actor, engine_span if cluster.colocate else 1)


def where_am_i() -> dict[str, Any]:
    """Called inside an actor: its node, placement bundle, GPUs and pid (tests assert placement with it)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
            "resources": ctx.get_assigned_resources()}
