"""Benchmark: rollout/train logprob mismatch with and without R3 (trainers/routing_replay.py), tiny MoE.

The engine samples N requests and records its routed experts; the FSDP2 trainer recomputes the
sampled tokens' logprobs with its own routing (natural) and with the engine's (R3). Prints mean and
max |engine logp - trainer logp| for each, their ratio, and the CPU-time cost of replay in the trainer.

Mismatch sources (``--source``; the trainer is fp32 in all of them):

* ``router-bf16`` (default, the one the test pins): the engine computes its MoE router in bf16, as an
  inference engine serving a bf16 checkpoint runs the gate GEMM, while the trainer routes in fp32
  (Megatron's ``moe_router_dtype=fp32``); the rest of the network is fp32 on both sides, so the
  measurement isolates the routing error that R3 is for.
* ``bf16``: the whole engine in bf16. Most of the error is then bf16 noise everywhere, which no
  routing scheme removes; R3 removes the part due to flipped experts.

``--expert-scale`` multiplies the expert weights (default 30): at random init the experts' outputs are
near zero, so a token sent to another expert barely changes anything; in a trained MoE they carry the
MLP signal.

    python bench/routing_replay.py
    python bench/routing_replay.py --source bf16 --expert-scale 1
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

import torch
import torch.nn.functional as F

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny
from miles_agent.trainers import routing_replay
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory


def bf16_router(router: torch.nn.Module) -> None:
    def forward(h: torch.Tensor):
        logits = F.linear(h.reshape(-1, router.hidden_dim).bfloat16(), router.weight.bfloat16())
        top, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), router.top_k, dim=-1)
        return logits.float(), top / top.sum(-1, keepdim=True), ids

    router.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=("router-bf16", "bf16"), default="router-bf16")
    ap.add_argument("--expert-scale", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    with torch.no_grad():
        for mlp in (m for m in model.modules() if hasattr(m, "experts")):
            mlp.experts.gate_up_proj.mul_(args.expert_scale)
            mlp.experts.down_proj.mul_(args.expert_scale)
    engine_model = copy.deepcopy(model)
    if args.source == "bf16":
        engine_model = engine_model.bfloat16()
    else:
        for router in routing_replay.moe_routers(engine_model):
            bf16_router(router)
    engine = EmbeddedEngine(engine_model, tok, max_batch_size=16)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]

    async def rollout():
        return await asyncio.gather(*[engine.generate(
            p, SamplingParams(max_new_tokens=args.new, temperature=1.0, seed=1000 * args.seed + i),
            return_routed_experts=True) for i, p in enumerate(prompts)])

    trajs = []
    for p, c in zip(prompts, asyncio.run(rollout())):
        t = Trajectory(prompt_ids=p, routed_experts=c.routed_experts)
        t.append_model(c.output_ids, c.output_logprobs, weight_version=0, turn=0)
        t.reward = 0.0
        trajs.append(t.validate())
    results = {}
    for name, replay in (("natural", False), ("R3", True)):
        trainer = FSDP2Trainer(copy.deepcopy(model), tok, TrainConfig(micro_batch_tokens=1024),
                               AlgoConfig(routing_replay=replay))
        trainer.compute_logprobs(trajs[:2])  # warm-up
        start = time.process_time()
        logps = trainer.compute_logprobs(trajs)
        seconds = time.process_time() - start
        trainer.close()
        diffs = [abs(a - b) for t, row in zip(trajs, logps) for a, b in zip(row, t.rollout_logprobs)]
        results[name] = (sum(diffs) / len(diffs), max(diffs), seconds)
    tokens = sum(t.response_length for t in trajs)
    print(f"tiny-qwen3-moe, source={args.source}, expert scale {args.expert_scale:g}, {tokens} sampled tokens")
    for name, (mean, worst, seconds) in results.items():
        print(f"  {name:8} mean |dlogp| {mean:.3e}   max {worst:.3e}   trainer logprobs {seconds:.2f} s CPU")
    nat, r3 = results["natural"], results["R3"]
    print(f"  natural / R3: mean {nat[0] / r3[0]:.1f}x lower with R3, max {nat[1] / r3[1]:.1f}x; "
          f"replay cost {r3[2] / nat[2]:.2f}x trainer time")


if __name__ == "__main__":
    main()
