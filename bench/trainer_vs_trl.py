"""Benchmark: training throughput of our FSDP2 trainer vs TRL's GRPOTrainer, same model, same batch.

Both sides get the same already-sampled batch (B sequences, P prompt + C completion tokens, random
ids, advantages +-1) and do the same work per optimizer step: one forward over every sequence, the
clipped policy-gradient loss over completion tokens, backward, gradient clipping, AdamW. TRL's side
is ``GRPOTrainer.compute_loss`` (its own logprob and loss code) + ``accelerator.backward`` + clip +
its own optimizer, so TRL's generation is left out, as ours is. Figure: trained tokens (prompt +
completion) per second; ratio ours / TRL.

    python bench/trainer_vs_trl.py            # 64 x (64 + 96) tokens, 3 repeats of 3 steps
    python bench/trainer_vs_trl.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from typing import Any

import torch


def make_batch(n: int, prompt_len: int, completion_len: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"prompt": torch.randint(3, 250, (n, prompt_len), generator=g),
            "completion": torch.randint(3, 250, (n, completion_len), generator=g),
            "advantages": (torch.arange(n) % 2 * 2 - 1).float()}


def ours(model: torch.nn.Module, tok: Any, batch: dict[str, Any], steps: int) -> float:
    """Seconds per optimizer step of the FSDP2 trainer (one gloo rank, the embedded default)."""
    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.trainer import TrainBatch
    from miles_agent.trainers.fsdp2 import FSDP2Trainer
    from miles_agent.types import Trajectory

    trajs, advs = [], []
    for p, c, a in zip(batch["prompt"].tolist(), batch["completion"].tolist(), batch["advantages"].tolist()):
        t = Trajectory(prompt_ids=p, task_id="bench", group_id="g")
        t.append_model(c, [-1.0] * len(c), weight_version=0, turn=0)
        t.reward = a
        trajs.append(t)
        advs.append([a] * len(c))
    tokens = sum(len(t.tokens) for t in trajs)
    trainer = FSDP2Trainer(model, tok, TrainConfig(lr=1e-5, micro_batch_tokens=tokens), AlgoConfig())
    try:
        trainer.train_step(TrainBatch(trajs, advs))  # warm-up (allocator, autograd graph caches)
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(TrainBatch(trajs, advs))
        return (time.perf_counter() - t0) / steps
    finally:
        trainer.close()


def trl_trainer(model: torch.nn.Module, tok: Any, n: int, out_dir: str) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=n, num_generations=min(n, 8),
                      learning_rate=1e-5, max_grad_norm=1.0, beta=0.0, loss_type="dapo", use_cpu=True,
                      report_to="none", logging_steps=10**6, save_strategy="no", bf16=False, fp16=False)
    data = Dataset.from_dict({"prompt": ["What is 1+1?"] * n})
    return GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                       args=args, train_dataset=data, processing_class=tok)


def trl(model: torch.nn.Module, tok: Any, batch: dict[str, Any], steps: int) -> float:
    """Seconds per optimizer step of TRL's GRPO loss/backward/step on the same batch."""
    with tempfile.TemporaryDirectory() as out:
        trainer = trl_trainer(model, tok, len(batch["prompt"]), out)
        trainer.create_optimizer()
        opt, model = trainer.optimizer, trainer.model
        n, c = batch["completion"].shape
        inputs = {"prompt_ids": batch["prompt"], "prompt_mask": torch.ones_like(batch["prompt"]),
                  "completion_ids": batch["completion"], "completion_mask": torch.ones(n, c, dtype=torch.long),
                  "advantages": batch["advantages"], "num_items_in_batch": torch.tensor(float(n * c))}
        model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we drive the steps ourselves

        def step() -> None:
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps


def measure(repeats: int = 3, steps: int = 3, n: int = 64, prompt_len: int = 64, completion_len: int = 96,
            arch: str = "tiny-qwen3") -> dict[str, Any]:
    from miles_agent.errors import require
    from miles_agent.models.builder import build_tiny

    require("trl", "bench", "the TRL baseline")
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    model, tok = build_tiny(arch, seed=0)
    batch = make_batch(n, prompt_len, completion_len)
    tokens = n * (prompt_len + completion_len)
    ratios, ours_tps, trl_tps = [], [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both sides alike
        a = tokens / ours(copy.deepcopy(model), tok, batch, steps)
        b = tokens / trl(copy.deepcopy(model), tok, batch, steps)
        ours_tps.append(a)
        trl_tps.append(b)
        ratios.append(a / b)
    return {"ratios": {"trainer tokens/s: ours (FSDP2) / TRL GRPOTrainer": ratios},
            "detail": {"arch": arch, "batch": f"{n} x ({prompt_len} prompt + {completion_len} completion) tokens",
                       "ours_tokens_per_s": ours_tps, "trl_tokens_per_s": trl_tps, "steps_per_repeat": steps}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = measure(1, 1, 8, 16, 16) if a.quick else measure(a.repeats)
    for name, values in out["ratios"].items():
        print(f"{name}: median {statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f})")
    print(out["detail"])


if __name__ == "__main__":
    main()
