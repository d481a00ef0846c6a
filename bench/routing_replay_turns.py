"""Benchmark: which engine call's routing a multi-turn trajectory should replay (R3), tiny MoE.

A two-turn episode makes two engine calls; the second re-runs the first turn's tokens. One trainer
forward can replay one routing per token, so for the first turn's tokens it must pick between the
routing of the call that sampled them ("first call", what `RoutingCapture` replays) and the second
call's re-run ("last call", what it replayed before). The ideal, per sampled token, is the routing of
the call that sampled it on every earlier token (one forward per call). This prints the mean
|trainer logp - ideal logp| over all sampled tokens for each choice, in two settings:

* ``same``: both turns on the same weights (sync mode). The calls differ only where the engine's bf16
  router resolves a near-tie differently in the re-run's prefill than in the first call's decode.
* ``update``: a weight update lands between the turns (async mode; version 1 = version 0 plus noise of
  ``--update-scale`` x each tensor's std, standing in for a training step); the trainer is on version 1.

The engine routes in bf16 with experts x30, the trainer is fp32 (see bench/routing_replay.py).

    python bench/routing_replay_turns.py
"""

from __future__ import annotations

import argparse
import asyncio
import copy

import numpy as np
import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny
from miles_agent.trainers import routing_replay
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.transports import InProcessTransport
from miles_agent.types import Trajectory

try:
    from bench.routing_replay import bf16_router
except ImportError:  # run as a script from bench/
    from routing_replay import bf16_router

OBSERVATION = [5, 6, 7, 8]


def two_turn_episodes(model, tok, other, n: int, tokens: int, seed: int):
    """n episodes of two calls; ``other`` (weights or None) is pushed between the turns."""
    engine_model = copy.deepcopy(model)
    for router in routing_replay.moe_routers(engine_model):
        bf16_router(router)
    engine = EmbeddedEngine(engine_model, tok, max_batch_size=n)
    engine.eos_ids = frozenset()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]

    async def turn(trajs, t):
        return await asyncio.gather(*[engine.generate(
            x.tokens, SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=seed * 10_000 + 10 * i + t),
            return_routed_experts=True) for i, x in enumerate(trajs)])

    async def run():
        trajs = [Trajectory(prompt_ids=p) for p in prompts]
        first = await turn(trajs, 0)
        for x, c in zip(trajs, first):
            x.append_model(c.output_ids, c.output_logprobs, c.weight_version, 0)
            x.append_observation(OBSERVATION, 0)
        if other is not None:
            await InProcessTransport([engine]).push(other.state_dict().items(), version=1)
        last = await turn(trajs, 1)
        for x, c in zip(trajs, last):
            x.append_model(c.output_ids, c.output_logprobs, c.weight_version, 1)
            x.reward = 0.0
        await engine.shutdown()
        return trajs, first, last

    return asyncio.run(run())


def logprobs(trainer, trajs, rows) -> list[np.ndarray]:
    for t, r in zip(trajs, rows):
        t.routed_experts = r
    return [np.array(x) for x in trainer.compute_logprobs(trajs)]


def measure(setting: str, n: int, tokens: int, seed: int, update_scale: float) -> dict[str, float]:
    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    with torch.no_grad():
        for mlp in (m for m in model.modules() if hasattr(m, "experts")):
            mlp.experts.gate_up_proj.mul_(30.0)
            mlp.experts.down_proj.mul_(30.0)
    other = None
    if setting == "update":
        other = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * p.float().std() * update_scale)
    trajs, first, last = two_turn_episodes(model, tok, other, n, tokens, seed)
    trainer = FSDP2Trainer(copy.deepcopy(other or model), tok, TrainConfig(micro_batch_tokens=4096),
                           AlgoConfig(routing_replay=True))

    def pad(r, t):
        out = np.full((len(t.tokens) - 1, *r.shape[1:]), -1, dtype=np.int32)
        out[:len(r)] = r
        return out

    by_first = [pad(f.routed_experts, t) for f, t in zip(first, trajs)]
    by_last = [pad(c.routed_experts, t) for c, t in zip(last, trajs)]
    composed = []
    for f, c, t in zip(first, last, trajs):
        rows = pad(c.routed_experts, t)
        rows[:len(f.routed_experts)] = f.routed_experts
        composed.append(rows)
    lp_first, lp_last, lp_composed = (logprobs(trainer, trajs, r) for r in (by_first, by_last, composed))
    trainer.close()
    err_first_call, err_last_call, flipped = [], [], 0
    for t, f, rerun, a, b, c in zip(trajs, first, last, lp_first, lp_last, lp_composed):
        turn0 = slice(0, len(f.output_ids))
        turn1 = slice(len(f.output_ids) + len(OBSERVATION), t.response_length)
        ideal = np.concatenate([a[turn0], b[turn1]])  # each token under the routing of its own call
        err_first_call.append(np.abs(np.concatenate([c[turn0], c[turn1]]) - ideal))
        err_last_call.append(np.abs(np.concatenate([b[turn0], b[turn1]]) - ideal))
        k = len(f.routed_experts)
        flipped += int((f.routed_experts != rerun.routed_experts[:k]).any(-1).any(-1).sum())
    first_call, last_call = np.concatenate(err_first_call), np.concatenate(err_last_call)
    return {"tokens": float(len(first_call)), "rows_rerouted": float(flipped),
            "first_call": float(first_call.mean()), "last_call": float(last_call.mean()),
            "first_call_max": float(first_call.max()), "last_call_max": float(last_call.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24, help="sampled tokens per turn")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--update-scale", type=float, default=0.02)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for setting in ("same", "update"):
        rows = [measure(setting, args.episodes, args.tokens, s, args.update_scale) for s in range(args.seeds)]
        first = sum(r["first_call"] for r in rows) / len(rows)
        last = sum(r["last_call"] for r in rows) / len(rows)
        print(f"{setting:>6}: {sum(r['tokens'] for r in rows):.0f} sampled tokens, "
              f"{sum(r['rows_rerouted'] for r in rows):.0f} turn-0 rows routed differently by the re-run | "
              f"mean |logp - ideal| first call {first:.2e} (max {max(r['first_call_max'] for r in rows):.2e}), "
              f"last call {last:.2e} (max {max(r['last_call_max'] for r in rows):.2e}) | "
              f"last/first {last / max(first, 1e-12):.1f}x")


if __name__ == "__main__":
    main()
