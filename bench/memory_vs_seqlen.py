"""Benchmark: peak memory of one FSDP2 train step against trajectory length, before and after.

One trajectory of T tokens (a 32-token prompt, the rest sampled response) in one micro-batch, one
PPO-clip train step through ``FSDP2Trainer`` on CPU. "before" is the path without the memory options
(logits_chunk_tokens=0: the LM head over every token at once, no activation checkpointing, padded
micro-batches); "after" is logits_chunk_tokens=1024, activation_checkpointing=true, pack_sequences=true.
The model is tiny-qwen3-shaped (hidden 128, 4 layers) with an 8192-token vocabulary, so the logits
weigh against the activations as in a real model (Qwen3: vocabulary / hidden ~ 150).

Each point runs in a fresh subprocess and reports its resident-set high-water mark during the step
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) minus its resident set before the step: torch has no
CPU allocator statistics, and tracemalloc does not see torch's allocations.

    python bench/memory_vs_seqlen.py                  # 1k -> 32k tokens (a few minutes on 2 cores)
    python bench/memory_vs_seqlen.py --max-tokens 4096  # quick
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

MODES = {
    "before": {"logits_chunk_tokens": 0, "activation_checkpointing": False, "pack_sequences": False},
    "after": {"logits_chunk_tokens": 1024, "activation_checkpointing": True, "pack_sequences": True},
}
VOCAB = 8192


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def one_point(tokens: int, mode: str, dtype: str) -> dict[str, float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.trainer import TrainBatch
    from miles_agent.trainers.fsdp2 import FSDP2Trainer
    from miles_agent.types import Trajectory

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=128, intermediate_size=384,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=tokens + 8, tie_word_embeddings=True, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    train = TrainConfig(lr=1e-5, micro_batch_tokens=tokens, **MODES[mode])
    trainer = FSDP2Trainer(model, SimpleNamespace(pad_token_id=0), train, AlgoConfig())
    g = torch.Generator().manual_seed(0)

    def batch(length: int) -> TrainBatch:
        t = Trajectory(prompt_ids=torch.randint(1, VOCAB, (32,), generator=g).tolist())
        n = length - 32
        t.append_model(torch.randint(1, VOCAB, (n,), generator=g).tolist(), [-9.0] * n, weight_version=0, turn=0)
        t.reward = 1.0
        return TrainBatch([t.validate()], [[1.0] * n])

    trainer.train_step(batch(96))  # warm-up: kernels' code and workspaces, the optimizer state
    big = batch(tokens)
    before = rss_mib()
    t0 = time.perf_counter()
    trainer.train_step(big)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    trainer.close()
    return {"tokens": tokens, "mode": mode, "peak_mib": peak - before, "step_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--dtype", default="float32", help="model.dtype (bfloat16: bf16 compute over fp32 masters)")
    ap.add_argument("--json", type=Path, default=None, help="also write the points here")
    ap.add_argument("--point", nargs=2, metavar=("TOKENS", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(one_point(int(args.point[0]), args.point[1], args.dtype)))
        return
    lengths = [1024 * 2**i for i in range(6) if 1024 * 2**i <= args.max_tokens]
    points: dict[tuple[int, str], dict] = {}
    # growth: MiB per 1k more tokens since the previous point (the chunk's logits are a fixed cost)
    print(f"{'tokens':>7} {'before MiB':>11} {'after MiB':>10} {'before/after':>13} {'growth before':>14} "
          f"{'growth after':>13} {'before s':>9} {'after s':>8}", flush=True)
    prev = None
    for n in lengths:
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--point", str(n), mode, "--dtype", args.dtype],
                                 capture_output=True, text=True, check=True)
            points[(n, mode)] = json.loads(out.stdout.strip().splitlines()[-1])
        b, a = points[(n, "before")], points[(n, "after")]
        growth = ["", ""] if prev is None else [
            f"{(points[(n, m)]['peak_mib'] - points[(prev, m)]['peak_mib']) / ((n - prev) / 1024):.0f}/1k"
            for m in MODES]
        print(f"{n:>7} {b['peak_mib']:>11.0f} {a['peak_mib']:>10.0f} {b['peak_mib'] / a['peak_mib']:>13.1f} "
              f"{growth[0]:>14} {growth[1]:>13} {b['step_s']:>9.1f} {a['step_s']:>8.1f}", flush=True)
        prev = n
    if args.json:
        args.json.write_text(json.dumps(list(points.values()), indent=1))


if __name__ == "__main__":
    main()
