"""Two FSDP2 ranks as Ray actors (gloo on loopback) compute the same logprobs and take the same step as one
in-process rank."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import RunAborted
from miles_agent.models.builder import build_tiny
from miles_agent.runtime.trainer_actor import RayTrainerGroup
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory

ALGO = AlgoConfig(kl_coef=0.05, entropy_coef=0.01, loss_agg="seq_mean_token_mean")
# Lengths 10, 17, 8, 13, 5 with a 20-token budget: the ranks get different, uneven shares.
SHAPES = [(3, 4, 2), (5, 6, 5), (2, 3, 2), (4, 5, 3), (2, 3, 0)]


def make_batch() -> TrainBatch:
    trajs, advs = [], []
    for i, (n_prompt, n_model, n_obs) in enumerate(SHAPES):
        t = Trajectory(prompt_ids=[10 + i + k for k in range(n_prompt)], reward=float(i % 2))
        t.append_model([60 + 7 * i + k for k in range(n_model)], [-2.0] * n_model, weight_version=0, turn=0)
        if n_obs:
            t.append_observation([40 + k for k in range(n_obs)], turn=0)
            t.append_model([90 + i], [-1.5], weight_version=0, turn=1)
        trajs.append(t.validate())
        advs.append([(-1.0) ** i * (0.5 + 0.25 * i)] * t.response_length)
    return TrainBatch(trajs, advs)


def train_cfg(world_size: int) -> TrainConfig:
    return TrainConfig(lr=1e-3, micro_batch_tokens=20, world_size=world_size, adam_eps=1e-4)


def test_two_ray_ranks_match_one_in_process_rank(ray_session, tmp_path: Path):
    model, tok = build_tiny("tiny-qwen3", seed=0)
    group = RayTrainerGroup(copy.deepcopy(model), tok, train_cfg(2), ALGO, temperature=1.0, device="cpu",
                            options=lambda rank: {"num_cpus": 1})
    try:
        assert len(set(group.pids)) == 2
        # logprob passes: rank 0's rows, one per trajectory in order, before the step changes the policy
        lp2, ref2 = group.compute_logprobs(make_batch().trajectories), \
            group.compute_logprobs(make_batch().trajectories, reference=True)
        m2 = group.train_step(make_batch())
        w2 = dict(group.named_weights())
        group.save_checkpoint(tmp_path / "ckpt")  # every rank writes its shards into one whole checkpoint
        # A rank that dies ends the step at once (rank 0 is left waiting in a collective), with a resume hint.
        group.actors[1].crash.remote()
        with pytest.raises(RunAborted, match="rerun with --resume"):
            group.train_step(make_batch())
    finally:
        group.close()
    one = FSDP2Trainer(model, tok, train_cfg(1), ALGO)
    try:
        for rows2, rows1 in ((lp2, one.compute_logprobs(make_batch().trajectories)),
                             (ref2, one.compute_logprobs(make_batch().trajectories, reference=True))):
            assert [len(r) for r in rows2] == [t.response_length for t in make_batch().trajectories]
            for r2, r1 in zip(rows2, rows1):
                assert r2 == pytest.approx(r1, abs=1e-6)
        m1 = one.train_step(make_batch())
        w1 = dict(one.named_weights())
        assert abs(m2["loss"] - m1["loss"]) < 1e-6
        assert abs(m2["grad_norm"] - m1["grad_norm"]) < 1e-5 * m1["grad_norm"]
        assert m2["tokens"] == m1["tokens"] and m2["seqs"] == m1["seqs"] == 5
        assert list(w2) == list(w1)
        for k, v in w1.items():
            assert torch.allclose(w2[k], v, atol=1e-5, rtol=0), k
        # the 2-rank checkpoint loads into 1 rank: the same weights
        fresh_model, _ = build_tiny("tiny-qwen3", seed=1)
        one.close()
        reload = FSDP2Trainer(fresh_model, tok, train_cfg(1), ALGO)
        reload.load_checkpoint(tmp_path / "ckpt")
        for k, v in reload.named_weights():
            assert torch.allclose(v, w2[k], atol=0, rtol=0), k
        reload.close()
    finally:
        one.close()
