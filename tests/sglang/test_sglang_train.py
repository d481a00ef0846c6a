"""``miles-agent train ... rollout.engine=sglang sglang.external_urls=[...]``: two tiny steps against a fake
SGLang server, weights synced over the disk transport into the server's model."""

from __future__ import annotations

import asyncio
import json

import torch

from miles_agent.cli import main
from miles_agent.engine import SamplingParams
from miles_agent.engines.sglang.client import SGLangEngine
from miles_agent.models.builder import build_tiny, load_hf, save_hf

PROMPT = [5, 17, 42, 99, 3, 7]


@torch.no_grad()
def greedy(model: torch.nn.Module, n: int) -> list[int]:
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def test_train_two_steps_against_an_external_server(start_fake, tmp_path):
    model, tok = build_tiny("tiny-qwen3")
    ckpt = tmp_path / "init"
    save_hf(model, tok, ckpt)
    server = start_fake(str(ckpt), "--ignore-eos")  # the same initial weights as the trainer
    run_dir = tmp_path / "run"
    rc = main(["train", "--env", "arith-tools", "--hf-checkpoint", str(ckpt), "--run-dir", str(run_dir),
               "--steps", "2", "--no-progress", "rollout.engine=sglang", f"sglang.external_urls=[{server.url}]",
               "sync.transport=disk", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
               "env.max_turns=1", "env.max_new_tokens_per_turn=12"])
    assert rc == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["weight_version"]) for r in records] == [(0, 0), (1, 1)]  # the client's versions
    state = server.state()
    disk = [u for u in state["updates"] if u["endpoint"] == "update_weights_from_disk"]
    assert [u["weight_version"] for u in disk] == ["1", "2"] and all(u["paused"] for u in disk)
    assert state["weight_version"] == 2 and state["requests"] >= 4  # 2 prompts x 2 samples per step
    # the server now samples exactly as the trainer's final model
    final, _ = load_hf(run_dir / "final")
    client = SGLangEngine(server.url)

    async def gen():
        try:
            return await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0))
        finally:
            await client.shutdown()
    assert asyncio.run(gen()).output_ids == greedy(final, 6)
