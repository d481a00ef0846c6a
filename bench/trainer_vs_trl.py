"""Benchmark: training throughput of our FSDP2 trainer vs TRL's GRPOTrainer, same model, same batch.

Both sides get the same already-sampled batch -- B sequences of ragged prompt and completion lengths
(an agent batch: lengths spread +-50% around the prompt mean, +-75% around the completion mean), random
ids, advantages +-1 -- and do the same work per optimizer step: one forward over every sequence, the
clipped policy-gradient loss over completion tokens (token mean), backward, gradient clipping, AdamW.
TRL's side is ``GRPOTrainer.compute_loss`` (its own logprob and loss code) on the layout its generation
step builds (prompts left-padded, completions right-padded, masks) + ``accelerator.backward`` + clip +
its own optimizer; TRL's generation is left out, as ours is. Ours runs ``train.pack_sequences=true``
(varlen: no pad token computed) in one micro-batch, as TRL runs one forward. Figure: real tokens (prompt
+ completion) trained per second; ratio ours / TRL. Also printed: ours without packing (padded
micro-batches), and both on a uniform batch (no padding anywhere: what packing cannot win), and a
scaling table of step time against batch size and against sequence length.

    python bench/trainer_vs_trl.py            # 64 sequences, ~64 prompt + ~96 completion tokens, 3 repeats
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

MAIN = "trainer tokens/s: ours (FSDP2, packed) / TRL GRPOTrainer, ragged batch"
PADDED = "trainer tokens/s: ours (FSDP2, padded micro-batches) / TRL GRPOTrainer, ragged batch"
UNIFORM = "trainer tokens/s: ours (FSDP2, packed) / TRL GRPOTrainer, uniform batch (no padding)"
MAIN_CPU = "trainer tokens per CPU second: ours (FSDP2, packed) / TRL GRPOTrainer, ragged batch"


def spread(n: int, mean: int, frac: float, g: torch.Generator) -> list[int]:
    lo, hi = max(1, round(mean * (1 - frac))), max(1, round(mean * (1 + frac)))
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def make_batch(n: int, prompt_len: int, completion_len: int, seed: int = 0, ragged: bool = True) -> dict[str, Any]:
    """``n`` (prompt ids, completion ids, advantage); lengths ragged around the means unless ``ragged=False``."""
    g = torch.Generator().manual_seed(seed)
    plens = spread(n, prompt_len, 0.5, g) if ragged else [prompt_len] * n
    clens = spread(n, completion_len, 0.75, g) if ragged else [completion_len] * n
    return {"prompts": [torch.randint(3, 250, (p,), generator=g).tolist() for p in plens],
            "completions": [torch.randint(3, 250, (c,), generator=g).tolist() for c in clens],
            "advantages": [float(i % 2 * 2 - 1) for i in range(n)]}


def real_tokens(batch: dict[str, Any]) -> int:
    return sum(len(p) + len(c) for p, c in zip(batch["prompts"], batch["completions"]))


def timed(fn: Any, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of ``fn`` over ``steps`` calls: with one torch thread the CPU
    time is the work itself, which other jobs on a shared machine disturb less than the wall time."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def ours(model: torch.nn.Module, tok: Any, batch: dict[str, Any], steps: int,
         pack: bool = True) -> tuple[float, float]:
    """(wall, CPU) seconds per optimizer step of the FSDP2 trainer (one gloo rank, the embedded default)."""
    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.trainer import TrainBatch
    from miles_agent.trainers.fsdp2 import FSDP2Trainer
    from miles_agent.types import Trajectory

    trajs, advs = [], []
    for p, c, a in zip(batch["prompts"], batch["completions"], batch["advantages"]):
        t = Trajectory(prompt_ids=p, task_id="bench", group_id="g")
        t.append_model(c, [-1.0] * len(c), weight_version=0, turn=0)
        t.reward = a
        trajs.append(t)
        advs.append([a] * len(c))
    cfg = TrainConfig(lr=1e-5, micro_batch_tokens=real_tokens(batch), pack_sequences=pack)
    trainer = FSDP2Trainer(model, tok, cfg, AlgoConfig())
    try:
        trainer.train_step(TrainBatch(trajs, advs))  # warm-up (allocator, autograd graph caches)
        return timed(lambda: trainer.train_step(TrainBatch(trajs, advs)), steps)
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


def trl_inputs(batch: dict[str, Any], pad_id: int) -> dict[str, torch.Tensor]:
    """The batch as TRL's generation step lays it out: prompts left-padded, completions right-padded."""
    n = len(batch["prompts"])
    pmax, cmax = max(map(len, batch["prompts"])), max(map(len, batch["completions"]))
    prompt_ids, prompt_mask = torch.full((n, pmax), pad_id), torch.zeros(n, pmax, dtype=torch.long)
    comp_ids, comp_mask = torch.full((n, cmax), pad_id), torch.zeros(n, cmax, dtype=torch.long)
    for b, (p, c) in enumerate(zip(batch["prompts"], batch["completions"])):
        prompt_ids[b, pmax - len(p):], prompt_mask[b, pmax - len(p):] = torch.tensor(p), 1
        comp_ids[b, :len(c)], comp_mask[b, :len(c)] = torch.tensor(c), 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
            "completion_mask": comp_mask, "advantages": torch.tensor(batch["advantages"]),
            "num_items_in_batch": comp_mask.sum().float()}


def trl(model: torch.nn.Module, tok: Any, batch: dict[str, Any], steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per optimizer step of TRL's GRPO loss/backward/step on the same batch."""
    with tempfile.TemporaryDirectory() as out:
        trainer = trl_trainer(model, tok, len(batch["prompts"]), out)
        trainer.create_optimizer()
        opt, model = trainer.optimizer, trainer.model
        inputs = trl_inputs(batch, int(tok.pad_token_id or 0))
        model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we drive the steps ourselves

        def step() -> None:
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up
        return timed(step, steps)


def scaling(model: torch.nn.Module, tok: Any, n: int, prompt_len: int, completion_len: int,
            steps: int = 2) -> list[dict[str, Any]]:
    """Step time (mean of ``steps`` after a warm-up, each side) against batch size, then against mean
    completion length."""
    points = [("batch", m, prompt_len, completion_len) for m in (max(1, n // 4), max(1, n // 2), n)]
    points += [("seq len", max(1, n // 2), prompt_len, c) for c in (max(2, completion_len // 2), completion_len,
                                                                       2 * completion_len)]
    rows = []
    for axis, m, p, c in points:
        batch = make_batch(m, p, c, seed=1)
        a, b = ours(copy.deepcopy(model), tok, batch, steps)[0], trl(copy.deepcopy(model), tok, batch, steps)[0]
        rows.append({"axis": axis, "sequences": m, "mean_len": real_tokens(batch) / m,
                     "padded_len": max(map(len, batch["prompts"])) + max(map(len, batch["completions"])),
                     "tokens": real_tokens(batch), "ours_s": a, "trl_s": b})
    return rows


def measure(repeats: int = 3, steps: int = 3, n: int = 64, prompt_len: int = 64, completion_len: int = 96,
            arch: str = "tiny-qwen3", with_scaling: bool | None = None) -> dict[str, Any]:
    """The ratios (see the module docstring); ``with_scaling`` (default: unless ``n < 16``, a quick run) adds
    the scaling table."""
    from miles_agent.errors import require
    from miles_agent.models.builder import build_tiny

    require("trl", "bench", "the TRL baseline")
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    model, tok = build_tiny(arch, seed=0)
    ragged, uniform = make_batch(n, prompt_len, completion_len), make_batch(n, prompt_len, completion_len, ragged=False)
    tps: dict[str, list[float]] = {k: [] for k in ("ours", "ours_padded", "trl", "ours_uniform", "trl_uniform")}
    cpu: dict[str, list[float]] = {k: [] for k in tps}
    ratios: dict[str, list[float]] = {MAIN: [], PADDED: [], UNIFORM: [], MAIN_CPU: []}
    for _ in range(repeats):  # interleaved, so machine noise hits every side alike
        sides = {"ours": (ragged, {}), "trl": (ragged, None), "ours_padded": (ragged, {"pack": False}),
                 "ours_uniform": (uniform, {}), "trl_uniform": (uniform, None)}
        for k, (b, kw) in sides.items():
            wall, cpu_s = (trl(copy.deepcopy(model), tok, b, steps) if kw is None
                           else ours(copy.deepcopy(model), tok, b, steps, **kw))
            tps[k].append(real_tokens(b) / wall)
            cpu[k].append(real_tokens(b) / cpu_s)
        ratios[MAIN].append(tps["ours"][-1] / tps["trl"][-1])
        ratios[PADDED].append(tps["ours_padded"][-1] / tps["trl"][-1])
        ratios[UNIFORM].append(tps["ours_uniform"][-1] / tps["trl_uniform"][-1])
        ratios[MAIN_CPU].append(cpu["ours"][-1] / cpu["trl"][-1])
    padded = n * (max(map(len, ragged["prompts"])) + max(map(len, ragged["completions"])))
    detail = {"arch": arch, "batch": f"{n} sequences, {real_tokens(ragged)} real tokens ({padded} in TRL's padded "
                                      f"layout); uniform: {n} x ({prompt_len} + {completion_len})",
              "steps_per_repeat": steps, **{f"{k}_tokens_per_s": v for k, v in tps.items()},
              **{f"{k}_tokens_per_cpu_s": v for k, v in cpu.items()}}
    if with_scaling or (with_scaling is None and n >= 16):
        detail["scaling"] = scaling(model, tok, n, prompt_len, completion_len, steps)
    return {"ratios": ratios, "detail": detail}


def print_report(out: dict[str, Any]) -> None:
    for name, values in out["ratios"].items():
        print(f"{name}: median {statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f})")
    d = out["detail"]
    print(f"{d['arch']}, {d['batch']}")
    for k in ("ours", "ours_padded", "trl", "ours_uniform", "trl_uniform"):
        v, c = d[f"{k}_tokens_per_s"], d[f"{k}_tokens_per_cpu_s"]
        print(f"  {k:>13} tokens/s: min {min(v):7.0f}  median {statistics.median(v):7.0f}  max {max(v):7.0f}"
              f"   per CPU s: median {statistics.median(c):7.0f}")
    if "scaling" in d:
        print(f"scaling (ragged batches, mean of {d['steps_per_repeat']} steps each side):")
        print(f"  {'axis':>7} {'seqs':>5} {'mean len':>8} {'TRL len':>7} {'tokens':>7} {'ours s':>7} {'TRL s':>7} "
              f"{'ours tok/s':>10} {'TRL tok/s':>9} {'ratio':>6}")
        for r in d["scaling"]:
            print(f"  {r['axis']:>7} {r['sequences']:>5} {r['mean_len']:>8.0f} {r['padded_len']:>7} {r['tokens']:>7} "
                  f"{r['ours_s']:>7.3f} {r['trl_s']:>7.3f} {r['tokens'] / r['ours_s']:>10.0f} "
                  f"{r['tokens'] / r['trl_s']:>9.0f} {r['trl_s'] / r['ours_s']:>5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-scaling", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = measure(1, 1, 8, 16, 16) if a.quick else measure(a.repeats, with_scaling=not a.no_scaling)
    print_report(out)


if __name__ == "__main__":
    main()
