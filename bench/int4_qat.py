"""Benchmark: rollout/train logprob mismatch of INT4 rollouts, with QAT against post-training quantization.

Both runs sample from the embedded engine with packed int4 weights (``rollout.weight_format=int4``,
symmetric, 32-element groups, requantized at every sync) on arith-tools from its warm start, and train
the full policy. PTQ (``train.qat=none``): the trainer scores the samples with the full-precision weights,
so every logprob it computes differs from the engine's by the int4 rounding. QAT (``train.qat=int4``):
the trainer's forward fake-quantizes the same weights the same way (straight-through gradients), so it
scores the policy the engine actually sampled from. The figure is ``mismatch/int4`` (mean |train - rollout|
logprob over the sampled tokens, the trainer's own measurement) averaged over the steps; the ratio
PTQ / QAT must be >= 5 (exit status 1 otherwise).

    python bench/int4_qat.py               # ~3 min on 2 cores
    python bench/int4_qat.py --steps 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from statistics import mean


def run(qat: str, steps: int) -> dict[str, float]:
    from miles_agent.config import load_config
    from miles_agent.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("tiny-cpu", {"run.steps": steps, "run.run_dir": tmp, "run.progress": False,
                                       "run.checkpoint_every": 0, "rollout.weight_format": "int4",
                                       "train.qat": qat, "rollout.prompts_per_step": 4})
        records = train(cfg)
    return {"mismatch": mean(r["mismatch/int4"] for r in records),
            "mismatch_max": max(r["train/logprob_mismatch_max"] for r in records),
            "reward": mean(r["reward_mean"] for r in records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    results = {"ptq": run("none", args.steps), "qat": run("int4", args.steps)}
    ratio = results["ptq"]["mismatch"] / max(results["qat"]["mismatch"], 1e-12)
    print(f"{'int4 rollout':<22}{'mismatch mean':>16}{'mismatch max':>15}{'reward':>9}")
    for name, r in results.items():
        label = f"{name.upper()} (train.qat={'int4' if name == 'qat' else 'none'})"
        print(f"{label:<22}"
              f"{r['mismatch']:>16.3e}{r['mismatch_max']:>15.3e}{r['reward']:>9.3f}")
    print(f"PTQ / QAT mismatch ratio: {ratio:.1f}x (needs >= 5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "ratio": ratio, "steps": args.steps}, f, indent=2)
    return 0 if ratio >= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
