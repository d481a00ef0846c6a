"""Several gloo ranks: the Megatron trainer with tensor parallelism (vocabulary-parallel logprobs, sharded
linears), pipeline parallelism (Megatron's schedule), and expert + data parallelism (each rank its share
of the batch, gradients summed) computes the single-process FSDP2 step, with every step option on at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_helpers import (
    advantages,
    assert_same_metrics,
    assert_same_weights,
    near_rollout_logprobs,
    trajectories,
)

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer

HERE = Path(__file__).parent
TRAIN = dict(lr=0.1, adam_eps=1.0, micro_batch_tokens=24, mini_batches=2)
ALGO = dict(use_rollout_logprobs=False, mismatch_correction="tis", mismatch_low=0.8, mismatch_high=1.25,
            kl_coef=0.5, kl_estimator="k2", loss_agg="group_mean_token_mean", entropy_coef=0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world: int, case_dir: Path) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "trainer_ranks.py"), str(r), str(world), str(port),
                               str(case_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [torch.load(case_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("arch,world,megatron", [
    ("tiny-qwen3", 2, dict(tensor_parallel=2)),
    # Megatron's 1F1B schedule over gloo; uneven stages (1 + 3 layers), tied embeddings across them
    ("tiny-qwen3", 2, dict(pipeline_parallel=2, first_stage_layers=1)),
    # data parallel 2, experts split over the two ranks (~40 s on 2 busy cores: nightly)
    pytest.param("tiny-qwen3-moe", 2, dict(expert_parallel=2), marks=pytest.mark.slow),
    # tensor 2 x pipeline 2: 4 processes, nightly
    pytest.param("tiny-qwen3", 4, dict(tensor_parallel=2, pipeline_parallel=2), marks=pytest.mark.slow),
])
def test_ranks_give_the_fsdp2_step(arch, world, megatron, tmp_path):
    algo, train = AlgoConfig(**ALGO), TrainConfig(**TRAIN)
    trajs = trajectories()
    model, tok = build_tiny(arch, seed=3)
    fsdp = FSDP2Trainer(model, tok, train, algo, temperature=0.8)
    try:
        near_rollout_logprobs(trajs, fsdp.compute_logprobs(trajs))
        adv = advantages(trajs)
        want = fsdp.train_step(TrainBatch(trajs, adv))
        want_weights = dict(fsdp.named_weights())
    finally:
        fsdp.close()
    case = dict(arch=arch, seed=3, temperature=0.8, train=TRAIN, algo=ALGO, megatron=megatron,
                trajectories=[t.to_dict() for t in trajs], advantages=adv)
    (tmp_path / "case.json").write_text(json.dumps(case))
    results = _run_ranks(world, tmp_path)
    initial = build_tiny(arch, seed=3)[0].state_dict()
    for r in results:  # every rank reports the global metrics and gathers the same full weights
        assert_same_metrics(r["metrics"], want)
        assert_same_weights(r["weights"], want_weights, initial)
    assert want["optimizer_steps"] == 2 and want["kl"] > 0 and 0 < want["mismatch_weight_mean"] < 1
