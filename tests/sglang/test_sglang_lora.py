"""LoRA over SGLang's API: a trained adapter, exported in peft's format, reaches the server through
``/load_lora_adapter`` (re-synced: unload, load, ``/update_weight_version``) and serves the requests that
name it in ``lora_path`` -- against the fake server, which applies it unmerged like the embedded engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded import lora as engine_lora
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.sglang.client import SGLangEngine
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.trainers.lora_options import LoraSection
from miles_agent.types import Trajectory

pytest.importorskip("peft")
PROMPT = [61, 62, 63, 64, 65]


def trained_adapter(tmp_path, steps: int):
    lora = LoraSection(rank=4, target_modules="q_proj,v_proj,gate_proj")
    model, tok = build_tiny("tiny-qwen3", seed=0)
    trainer = FSDP2Trainer(model, tok, TrainConfig(lr=5e-2, grad_clip=0.0), AlgoConfig(), lora=lora)
    for _ in range(steps):
        trajs = []
        for i in range(4):
            t = Trajectory(prompt_ids=PROMPT, task_id=f"t{i}", group_id="g")
            t.append_model([70 + i, 80 + i, 90 + i], [-1.0] * 3, weight_version=0, turn=0)
            t.reward = float(i % 2)
            trajs.append(t.validate())
        for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
            t.rollout_logprobs = lp
        trainer.train_step(TrainBatch(trajs, [[1.0 if t.reward else -1.0] * 3 for t in trajs]))
    weights = list(trainer.named_weights())
    trainer.save_hf(tmp_path / f"v{steps}")
    trainer.close()
    return lora, weights, str(tmp_path / f"v{steps}" / "default")


def local_greedy(lora, weights, lora_path):
    model, tok = build_tiny("tiny-qwen3", seed=0)
    rows = engine_lora.install(model, lora.names, lora.rank, lora.scaling, lora.targets)
    engine = EmbeddedEngine(model, tok, max_batch_size=4)
    engine.eos_ids = frozenset()
    engine_lora.attach(engine, rows)
    engine.runner.load_weights(weights)
    return asyncio.run(engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0, lora_path=lora_path)))


def test_adapter_synced_over_sglang_api_serves_its_requests(start_fake, tmp_path):
    server = start_fake("tiny-qwen3", "--ignore-eos")
    lora, w1, folder1 = trained_adapter(tmp_path, 1)
    _, w2, folder2 = trained_adapter(tmp_path, 3)
    client = SGLangEngine(server.url)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, lora_path="default")

    async def main():
        try:
            with pytest.raises(ValueError, match="not loaded"):
                await client.generate(PROMPT, greedy)
            await client.sync_lora_adapters({"default": folder1}, version=1)
            first = await client.generate(PROMPT, greedy)
            base = await client.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0))
            await client.sync_lora_adapters({"default": folder2}, version=2)  # unload + load: a new version
            second = await client.generate(PROMPT, greedy)
            return first, base, second
        finally:
            await client.shutdown()

    first, base, second = asyncio.run(main())
    want1, want2 = local_greedy(lora, w1, "default"), local_greedy(lora, w2, "default")
    assert first.output_ids == want1.output_ids and first.output_logprobs == pytest.approx(want1.output_logprobs, abs=1e-4)
    assert second.output_logprobs == pytest.approx(want2.output_logprobs, abs=1e-4)
    assert base.output_logprobs != pytest.approx(first.output_logprobs, abs=1e-3)  # no lora_path: the base model
    assert first.weight_version == 1 and second.weight_version == 2
    calls = [e["call"] for e in server.state()["events"] if e["call"] != "generate"]
    assert calls == ["load_lora_adapter", "update_weight_version", "unload_lora_adapter", "load_lora_adapter",
                     "update_weight_version"], calls
    assert torch.is_tensor(w1[0][1])
