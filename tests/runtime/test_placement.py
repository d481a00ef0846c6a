"""Placement: which bundle (and which fake GPU) each trainer rank and engine lands in, colocated or not."""

from __future__ import annotations

import pytest

from miles_agent.config import ClusterConfig
from miles_agent.errors import UserError
from miles_agent.runtime.ray_cluster import bundle_specs, place, where_am_i


def test_disaggregated_bundles_keep_trainer_and_engines_apart():
    bundles, trainer, engines = bundle_specs(ClusterConfig(num_engines=2, trainer_gpus=1, gpus_per_engine=1), 2)
    assert bundles == [{"CPU": 1.0, "GPU": 1}] * 4
    assert trainer == [0, 1] and engines == [2, 3]


def test_colocated_engines_share_their_rank_bundle():
    bundles, trainer, engines = bundle_specs(
        ClusterConfig(num_engines=1, colocate=True, trainer_gpus=0.5, gpus_per_engine=0.5), 2)
    assert bundles == [{"CPU": 2.0, "GPU": 1}] * 2 and trainer == [0, 1] and engines == [0]
    cpu_only, _, _ = bundle_specs(ClusterConfig(num_engines=2, colocate=True), 2)
    assert cpu_only == [{"CPU": 2.0}] * 2


@pytest.mark.parametrize("cluster, match", [
    (ClusterConfig(num_engines=3, colocate=True), "num_engines=3 needs train.world_size >= 3"),
    (ClusterConfig(colocate=True, trainer_gpus=1, gpus_per_engine=0.5), "must fit one device"),
    (ClusterConfig(num_engines=0), "num_engines must be >= 1"),
])
def test_impossible_topologies_are_clear_errors(cluster, match):
    with pytest.raises(UserError, match=match):
        bundle_specs(cluster, 2)


def _land(ray, placement, world_size: int, num_engines: int) -> tuple[list[dict], list[dict]]:
    probe = ray.remote(where_am_i)
    ranks = ray.get([probe.options(**placement.trainer_options(r)).remote() for r in range(world_size)])
    engines = ray.get([probe.options(**placement.engine_options(i)).remote() for i in range(num_engines)])
    return ranks, engines


def test_actors_land_in_their_bundles_with_fake_gpus(ray_session):
    ray = ray_session
    colocated = place(ClusterConfig(num_engines=2, colocate=True, trainer_gpus=0.5, gpus_per_engine=0.5), 2)
    try:
        ranks, engines = _land(ray, colocated, 2, 2)
        table = ray.util.placement_group_table(colocated.group)
        assert table["bundles"] == {0: {"CPU": 2.0, "GPU": 1.0}, 1: {"CPU": 2.0, "GPU": 1.0}}
        assert all(x["placement_group"] == colocated.group.id.hex() for x in ranks + engines)
        # engine i shares rank i's device, and the two ranks have different devices
        assert [e["gpu_ids"] for e in engines] == [r["gpu_ids"] for r in ranks]
        assert len({r["gpu_ids"][0] for r in ranks}) == 2
        assert all(x["resources"]["GPU"] == 0.5 for x in ranks + engines)
        assert {x["node_id"] for x in ranks + engines} == set(table["bundles_to_node_id"].values())
    finally:
        colocated.remove()
    apart = place(ClusterConfig(num_engines=2, trainer_gpus=1, gpus_per_engine=1), 2)
    try:
        ranks, engines = _land(ray, apart, 2, 2)
        gpus = [x["gpu_ids"] for x in ranks + engines]
        assert all(len(g) == 1 for g in gpus) and len({g[0] for g in gpus}) == 4  # every actor its own device
    finally:
        apart.remove()


def test_a_topology_larger_than_the_cluster_is_a_clear_error(ray_session, monkeypatch):
    from miles_agent.runtime import ray_cluster

    monkeypatch.setattr(ray_cluster, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(UserError, match="could not place 3 bundles"):
        place(ClusterConfig(num_engines=1, trainer_gpus=2, gpus_per_engine=1), 2)  # 2 ranks x 2 GPUs + more than the 4 there are


def test_unknown_cluster_mode_and_ray_only_transports_are_clear_errors():
    from miles_agent.components import build_trainer
    from miles_agent.config import load_config
    from miles_agent.runtime.launch import RayCluster

    with pytest.raises(UserError, match=r"unknown cluster mode 'slurm' \(cluster.mode=slurm\); installed: inprocess, ray"):
        build_trainer(load_config(None, {"cluster.mode": "slurm"}), None, None)
    with pytest.raises(UserError, match="sync.transport=disk is for cluster.mode=inprocess"):
        RayCluster(load_config(None, {"cluster.mode": "ray", "sync.transport": "disk"})).transport(None, [None])
