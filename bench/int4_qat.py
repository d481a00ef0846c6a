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
from statistics import mean, median


def run(qat: str, steps: int) -> dict[str, float]:
    from miles_agent.config import load_config
    from miles_agent.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("tiny-cpu", {"run.steps": steps, "run.run_dir": tmp, "run.progress": False,
                                       "run.checkpoint_every": 0, "rollout.weight_format": "int4",
                                       "train.qat": qat, "rollout.prompts_per_step": 4})
        records = train(cfg)
    steps = [r["mismatch/int4"] for r in records]
    return {"mismatch": mean(steps), "mismatch_min": min(steps), "mismatch_median": median(steps),
            "mismatch_max": max(steps), "token_max": max(r["train/logprob_mismatch_max"] for r in records),
            "per_step": steps, "reward": mean(r["reward_mean"] for r in records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    results = {"ptq": run("none", args.steps), "qat": run("int4", args.steps)}
    ratio = results["ptq"]["mismatch"] / max(results["qat"]["mismatch"], 1e-12)
    print("per-step mean |train - rollout| logprob over the sampled tokens; token max: the worst token")
    cols = ("mean", "min", "median", "max")
    print(f"{'int4 rollout':<22}" + "".join(f"{c:>11}" for c in cols) + f"{'token max':>11}{'reward':>8}")
    for name, r in results.items():
        label = f"{name.upper()} (train.qat={'int4' if name == 'qat' else 'none'})"
        vals = [r["mismatch"], r["mismatch_min"], r["mismatch_median"], r["mismatch_max"], r["token_max"]]
        print(f"{label:<22}" + "".join(f"{v:>11.2e}" for v in vals) + f"{r['reward']:>8.3f}")
    worst = results["ptq"]["mismatch_min"] / max(results["qat"]["mismatch_max"], 1e-12)
    print(f"PTQ / QAT mismatch ratio: {ratio:.1f}x (needs >= 5x); "
          f"worst case (PTQ's best step / QAT's worst step): {worst:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "ratio": ratio, "worst_case_ratio": worst, "steps": args.steps}, f, indent=2)
    return 0 if ratio >= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
