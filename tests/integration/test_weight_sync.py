"""After a weight sync the engine samples from the trainer's weights, and says which version it used."""

from __future__ import annotations

import asyncio
import copy

import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.transports import InProcessTransport, buckets
from miles_agent.types import Trajectory


def test_engine_follows_trainer_weights_after_sync():
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen3", seed=0)
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=8)
    trainer = FSDP2Trainer(model, tok, TrainConfig(lr=5e-2), AlgoConfig(loss="sft"))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)

    # A large SFT step towards a fixed reply changes what greedy decoding produces.
    target = tok.encode("zzzzzzzzzzzz", add_special_tokens=False)
    t = Trajectory(prompt_ids=prompt)
    t.append_model(target, [-1.0] * len(target), weight_version=0, turn=0)
    t.reward = 0.0
    for _ in range(5):
        trainer.train_step(TrainBatch([t], [[0.0] * t.response_length]))
    reference, _ = build_tiny("tiny-qwen3", seed=0)
    reference.load_state_dict({n: w.clone() for n, w in trainer.named_weights()})
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()

    async def run():
        before = await engine.generate(prompt, greedy)
        metrics = await InProcessTransport([engine], bucket_bytes=64 << 10).push(trainer.named_weights(), version=1)
        after = await engine.generate(prompt, greedy)
        await engine.shutdown()
        return before, after, metrics

    before, after, metrics = asyncio.run(run())
    assert before.weight_version == 0 and after.weight_version == 1
    assert after.output_ids[: len(expected)] == expected[: len(after.output_ids)]
    assert after.output_ids != before.output_ids
    assert metrics["sync_buckets"] > 1  # the 64 KiB bucket limit split the push
    trainer.close()


def test_buckets_respect_the_size_limit():
    tensors = [(f"w{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    out = list(buckets(tensors, 1000))
    assert [len(b) for b in out] == [2, 2, 2, 2, 2]
    assert [n for b in out for n, _ in b] == [n for n, _ in tensors]
    assert [len(b) for b in buckets([("big", torch.zeros(1000))], 100)] == [1]
