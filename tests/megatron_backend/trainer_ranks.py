"""Run by test_megatron_ranks.py in N gloo processes: one Megatron trainer step over a batch the parent
wrote (``case.json``), under the parallel layout it names; each rank saves its metrics and the full
weights it gathers, for the parent to compare with the single-process FSDP2 step."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch


def main(rank: int, world: int, port: int, case_dir: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.models.builder import build_tiny
    from miles_agent.trainer import TrainBatch
    from miles_agent.trainers.megatron.options import MegatronConfig
    from miles_agent.trainers.megatron.trainer import MegatronTrainer
    from miles_agent.types import Trajectory

    case = json.loads((Path(case_dir) / "case.json").read_text())
    model, tok = build_tiny(case["arch"], seed=case["seed"])
    trainer = MegatronTrainer(model, tok, TrainConfig(**case["train"], world_size=world), AlgoConfig(**case["algo"]),
                              temperature=case["temperature"], megatron=MegatronConfig(**case["megatron"]))
    trajs = [Trajectory.from_dict(d) for d in case["trajectories"]]
    metrics = trainer.train_step(TrainBatch(trajs, case["advantages"]))
    weights = {k: v.clone() for k, v in trainer.named_weights()}
    torch.save({"metrics": metrics, "weights": weights}, Path(case_dir) / f"rank{rank}.pt")
    trainer.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
