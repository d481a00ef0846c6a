"""The Ray trainer group is a `Trainer`: the contract suite against it with one and two CPU ranks (gloo on
loopback), and what the core calls on a trainer working under ``cluster.mode=ray``."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import train_then_close

from miles_agent.config import load_config
from miles_agent.loop import Run
from miles_agent.testing.contracts import TrainerContract

TINY = {"model.warm_start": None, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "env.max_new_tokens_per_turn": 6, "env.max_turns": 1, "run.progress": False, "run.steps": 1,
        "run.checkpoint_every": 0, "cluster.mode": "ray", "cluster.num_engines": 1, "train.world_size": 1,
        "cluster.health_check_interval_s": 0}


def ray_group(world_size: int):
    """A ``train.backend``-shaped factory building a `RayTrainerGroup` of ``world_size`` FSDP2 ranks."""
    from miles_agent.runtime.trainer_actor import RayTrainerGroup

    def make(model, tok, train, algo, *, temperature, **kwargs):
        return RayTrainerGroup(model, tok, dataclasses.replace(train, world_size=world_size), algo,
                               temperature=temperature, device="cpu", options=lambda rank: {"num_cpus": 1}, **kwargs)

    return make


class RayGroupContract(TrainerContract):
    @pytest.mark.skip(reason="the ranks offload themselves (train.offload): tests/runtime/test_colocate_offload.py")
    def test_offload_then_reload_gives_back_the_same_trainer(self) -> None: ...


class TestRayGroupOneRank(RayGroupContract):
    @pytest.fixture
    def trainer_class(self, ray_session):
        return ray_group(1)


@pytest.mark.slow
class TestRayGroupTwoRanks(RayGroupContract):
    @pytest.fixture
    def trainer_class(self, ray_session):
        return ray_group(2)


def test_kl_in_the_reward_trains_under_ray(ray_session, tmp_path):
    """algo.kl_reward_coef > 0: the batch builder asks the trainer for reference and current logprobs
    (the group had no compute_logprobs: AttributeError). Colocated, so the ranks offload: the engines
    release the device once, before the first logprob pass, and the ranks stay resident to the gather."""
    cfg = load_config("tiny-cpu", {**TINY, "algo.advantage": "reinforce_pp_baseline", "algo.kl_reward_coef": 0.05,
                                   "cluster.colocate": True, "cluster.trainer_gpus": 0.5,
                                   "cluster.gpus_per_engine": 0.5, "run.run_dir": str(tmp_path)})
    run = Run(cfg)
    released = []
    release = run.cluster.session.engines.release_memory
    run.cluster.session.engines.release_memory = lambda: (released.append(1), release())[1]

    records, log = train_then_close(run)
    assert [r["step"] for r in records] == [0] and records[0]["train/reload_s"] >= 0
    assert len(released) == 1
    # the reference pass (the old logprobs are the rollout's: algo.use_rollout_logprobs)
    assert [e for e, _, _ in log] == ["offload", "reload", "compute_logprobs", "train_step", "gather", "offload",
                                      "reload", "save_checkpoint", "offload", "reload", "save_hf", "offload"]
    assert run.cluster.session.closed
