"""Benchmark: the cost of true on-policy mode (miles_agent/true_on_policy.py) against the normal mode.

Same tiny model, same process, same workload in both modes: the embedded engine serves N concurrent
requests with continuous batching (tokens per second of CPU time), then the FSDP2 trainer runs
``compute_logprobs`` (no-grad forward) and one ``train_step`` (forward + backward) over the resulting
trajectories. Prints each figure and the ratio normal / true-on-policy (how many times slower the mode
is), plus the mean |engine logp - trainer logp| of each mode (exactly 0 in true on-policy mode).

Timing is process CPU time (all threads), so a machine shared with other jobs does not skew the ratio.

    python bench/true_on_policy.py            # tiny-qwen3-moe, 16 requests x 64 tokens
    python bench/true_on_policy.py --quick    # a few seconds
    python bench/true_on_policy.py --arch tiny-qwen3
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory


def rollout(engine: EmbeddedEngine, n: int, new: int) -> tuple[list[Trajectory], float]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]

    async def main():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=new, temperature=1.0, seed=i))
                                      for i, p in enumerate(prompts)])

    start = time.process_time()
    completions = asyncio.run(main())
    seconds = time.process_time() - start
    trajs = []
    for p, c in zip(prompts, completions):
        t = Trajectory(prompt_ids=p)
        t.append_model(c.output_ids, c.output_logprobs, weight_version=0, turn=0)
        t.reward = 0.0
        trajs.append(t.validate())
    return trajs, seconds


def measure(arch: str, exact: bool, n: int, new: int) -> dict[str, float]:
    model, tok = build_tiny(arch, seed=0)
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=n, true_on_policy=exact)
    engine.eos_ids = frozenset()
    rollout(engine, 2, 4)  # warm-up
    trajs, gen_s = rollout(engine, n, new)
    tokens = sum(t.response_length for t in trajs)
    trainer = FSDP2Trainer(model, tok, TrainConfig(micro_batch_tokens=2048), AlgoConfig(true_on_policy=exact))
    start = time.process_time()
    logps = trainer.compute_logprobs(trajs)
    logp_s = time.process_time() - start
    batch = TrainBatch(trajs, [[0.1] * t.response_length for t in trajs])
    start = time.process_time()
    trainer.train_step(batch)
    step_s = time.process_time() - start
    trainer.close()
    diffs = [abs(a - b) for t, row in zip(trajs, logps) for a, b in zip(row, t.rollout_logprobs)]
    return {"gen_tok_s": tokens / gen_s, "logp_s": logp_s, "step_s": step_s, "mismatch": sum(diffs) / len(diffs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="tiny-qwen3-moe")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n, new = (4, 16) if args.quick else (args.requests, args.new)
    normal, exact = measure(args.arch, False, n, new), measure(args.arch, True, n, new)
    print(f"{args.arch}: {n} concurrent requests x {new} tokens, CPU time, {torch.get_num_threads()} threads")
    print(f"{'':24}{'normal':>12}{'true on-policy':>16}{'slowdown':>10}")
    print(f"{'engine tokens/s':24}{normal['gen_tok_s']:12.1f}{exact['gen_tok_s']:16.1f}"
          f"{normal['gen_tok_s'] / exact['gen_tok_s']:9.1f}x")
    for key, name in (("logp_s", "trainer logprobs s"), ("step_s", "trainer train_step s")):
        print(f"{name:24}{normal[key]:12.3f}{exact[key]:16.3f}{exact[key] / normal[key]:9.1f}x")
    print(f"{'mean |dlogp|':24}{normal['mismatch']:12.2e}{exact['mismatch']:16.2e}")


if __name__ == "__main__":
    main()
