"""Two gloo ranks on loopback take the same step as one rank: N ranks are only configuration."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory

# Sequence lengths 10, 17, 8, 13, 5: rank 0 gets 17 and 8, rank 1 gets 13, 10 and 5. With a budget
# of 20 tokens both ranks run two micro-batches ([17] [8] and [13] [10, 5]); with 14, rank 1 runs
# three ([13] [10] [5]) and rank 0 a filler after its two, to stay in lockstep. The last case takes two
# optimizer steps (mini-batches: group "0" = sequences 0, 2, 4, then group "1" = 1, 3) with group-level
# aggregation, whose row weights must come out the same on every rank.
CASES = ((20, 1, "seq_mean_token_mean"), (14, 1, "seq_mean_token_mean"), (14, 2, "group_mean_token_mean"))
SHAPES = [(3, 4, 2), (5, 6, 5), (2, 3, 2), (4, 5, 3), (2, 3, 0)]


def make_batch() -> TrainBatch:
    trajs, advs = [], []
    for i, (n_prompt, n_model, n_obs) in enumerate(SHAPES):
        t = Trajectory(prompt_ids=[10 + i + k for k in range(n_prompt)], reward=float(i % 2), group_id=str(i % 2))
        t.append_model([60 + 7 * i + k for k in range(n_model)], [-2.0] * n_model, weight_version=0, turn=0)
        if n_obs:
            t.append_observation([40 + k for k in range(n_obs)], turn=0)
            t.append_model([90 + i], [-1.5], weight_version=0, turn=1)
        trajs.append(t.validate())
        advs.append([(-1.0) ** i * (0.5 + 0.25 * i)] * t.response_length)
    return TrainBatch(trajs, advs)


def run_step(world_size: int, budget: int, mini_batches: int, loss_agg: str) -> tuple[dict[str, float],
                                                                                     dict[str, torch.Tensor]]:
    model, tok = build_tiny("tiny-qwen3", seed=0)
    trainer = FSDP2Trainer(model, tok, TrainConfig(lr=1e-3, micro_batch_tokens=budget, world_size=world_size,
                                                     adam_eps=1e-4,  # see test_micro_batches_accumulate...
                                                     mini_batches=mini_batches),
                           AlgoConfig(kl_coef=0.05, entropy_coef=0.01, loss_agg=loss_agg))
    metrics = trainer.train_step(make_batch())
    return metrics, {k: v.clone() for k, v in trainer.named_weights()}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {case: run_step(2, *case) for case in CASES}
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    two_ranks = torch.load(out, weights_only=False)
    for case in CASES:
        (m2, w2), (m1, w1) = two_ranks[case], run_step(1, *case)
        assert m2["optimizer_steps"] == m1["optimizer_steps"] == case[1]
        assert abs(m2["loss"] - m1["loss"]) < 1e-6
        assert abs(m2["grad_norm"] - m1["grad_norm"]) < 1e-5 * m1["grad_norm"]
        assert m2["tokens"] == m1["tokens"] and m2["seqs"] == m1["seqs"] == 5
        assert list(w2) == list(w1)
        for k, v in w1.items():
            assert torch.allclose(w2[k], v, atol=1e-5, rtol=0), k
