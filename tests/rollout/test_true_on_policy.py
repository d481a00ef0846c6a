"""True on-policy mode: the engine's sampled logprobs equal the trainer's bit for bit.

The engine runs continuous batching (requests of different lengths join and leave the decode batch,
prefilled in batches, decoded one token at a time against the KV cache); the trainer runs its normal
packed, right-padded micro-batches, with and without gradients.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_agent import true_on_policy as top
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory

TEMPERATURE = 0.8


def test_exact_primitives_are_accurate():
    x = torch.linspace(-80, 80, 4001)
    assert torch.allclose(top.det_exp(x), torch.exp(x), rtol=4e-7, atol=0)
    y = torch.logspace(-30, 30, 4001)
    assert torch.allclose(top.det_log(y), torch.log(y), rtol=2e-7, atol=1e-7)
    assert torch.allclose(top.det_rsqrt(y), torch.rsqrt(y), rtol=4e-7, atol=0)
    a, w = torch.randn(37, 96), torch.randn(50, 96)
    assert torch.allclose(top.det_matmul(a, w), a @ w.T, rtol=1e-5, atol=1e-5)
    s = torch.randn(5, 7, 70)
    assert torch.allclose(top.det_sum(s, 1), s.sum(1), rtol=1e-5, atol=1e-5)
    assert torch.allclose(top.det_log_softmax(s), torch.log_softmax(s, -1), rtol=1e-6, atol=1e-6)


def test_exact_reductions_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(300, 128, generator=g), torch.randn(384, 128, generator=g)
    full = top.det_matmul(a, w)
    assert all(torch.equal(top.det_matmul(a[i:i + 1], w), full[i:i + 1]) for i in (0, 17, 299))
    assert torch.equal(top.det_matmul(a[5:9], w), full[5:9])
    v = torch.randn(4, 45, generator=g)
    padded = torch.cat([v, torch.zeros(4, 83)], -1)  # trailing zeros: masked keys, a longer cache
    assert torch.equal(top.det_sum(v, -1), top.det_sum(padded, -1))
    assert torch.equal(top.det_sum(v[2:3], -1), top.det_sum(v, -1)[2:3])
    threads = torch.get_num_threads()
    try:  # nor on the thread count (another process, another machine size)
        torch.set_num_threads(1)
        assert torch.equal(top.det_matmul(a, w), full)
    finally:
        torch.set_num_threads(threads)


def _rollout(engine: EmbeddedEngine, n: int, seed: int = 0) -> list[Trajectory]:
    """``n`` requests of mixed prompt and output lengths, more than the engine's batch, so requests
    join the running batch as others finish (continuous batching)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    lengths = [int(torch.randint(40, 72, (1,), generator=g)) for _ in range(n)]

    async def main():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=m, temperature=TEMPERATURE,
                                                                        seed=i))
                                      for i, (p, m) in enumerate(zip(prompts, lengths))])

    trajs = []
    for p, c in zip(prompts, asyncio.run(main())):
        t = Trajectory(prompt_ids=p)
        t.append_model(c.output_ids, c.output_logprobs, weight_version=0, turn=0)
        t.reward = 0.0
        trajs.append(t.validate())
    return trajs


def test_engine_and_trainer_logprobs_are_bitwise_equal():
    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=8, true_on_policy=True)
    engine.eos_ids = frozenset()  # fixed lengths: the token count below does not depend on the samples
    trajs = _rollout(engine, n=20)
    sampled = sum(t.response_length for t in trajs)
    assert sampled >= 1000
    assert engine.stats["prefill_batches"] > 1 and engine.mean_decode_batch > 4  # really batched
    trainer = FSDP2Trainer(copy.deepcopy(model), tok, TrainConfig(micro_batch_tokens=600, lr=1e-3),
                           AlgoConfig(true_on_policy=True), temperature=TEMPERATURE)
    logps = trainer.compute_logprobs(trajs)  # packed into several right-padded micro-batches
    diffs = [a - b for t, row in zip(trajs, logps) for a, b in zip(row, t.rollout_logprobs)]
    assert len(diffs) == sampled and all(d == 0.0 for d in diffs), max(map(abs, diffs))
    # the engine's teacher-forced scoring (one causal forward, no cache) gives the same bits too
    t = trajs[3]
    scores = asyncio.run(engine.score(t.tokens, logprob_start_len=len(t.prompt_ids), temperature=TEMPERATURE))
    assert list(scores.input_token_logprobs) == logps[3]
    # the training forward (autograd through the exact kernels) sees the same numbers
    batch = TrainBatch(trajs[:4], [[1.0] * t.response_length for t in trajs[:4]])
    metrics = trainer.train_step(batch)
    assert metrics["logprob_mismatch_max"] == 0.0 and metrics["grad_norm"] > 0
    trainer.close()


def test_normal_mode_does_not_match_bitwise():
    """The control: without the mode, the same workload differs in the low bits."""
    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=8)
    engine.eos_ids = frozenset()
    trajs = _rollout(engine, n=10)
    trainer = FSDP2Trainer(copy.deepcopy(model), tok, TrainConfig(micro_batch_tokens=600), AlgoConfig(),
                           temperature=TEMPERATURE)
    diffs = [abs(a - b) for t, row in zip(trajs, trainer.compute_logprobs(trajs)) for a, b in zip(row, t.rollout_logprobs)]
    trainer.close()
    assert 0 < max(diffs) < 1e-3


def test_mode_errors_name_the_cause():
    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    with pytest.raises(UserError, match="exclusive"):
        FSDP2Trainer(model, tok, TrainConfig(), AlgoConfig(true_on_policy=True, routing_replay=True))
    model.config.hidden_act = "gelu"
    with pytest.raises(UserError, match="true_on_policy"):
        top.apply(model)
