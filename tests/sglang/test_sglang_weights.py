"""Every weight transport drives a (fake) SGLang server over HTTP, including while requests are in flight."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_agent.engine import FinishReason, PauseMode, SamplingParams
from miles_agent.engines.sglang.client import SGLangEngine
from miles_agent.models.builder import build_tiny
from miles_agent.transports.disk import DiskTransport
from miles_agent.transports.dist import DistributedTransport
from miles_agent.transports.shm import SharedMemoryTransport

PROMPT = [5, 17, 42, 99, 3, 7]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
ENDPOINTS = {"shm": ["update_weights_from_tensor"],
             "distributed": ["init_weights_update_group", "update_weights_from_distributed",
                             "destroy_weights_update_group"],
             "disk": ["update_weights_from_disk"]}


def trainer_weights(seed: int) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
    model, _ = build_tiny("tiny-qwen3", seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return model, list(model.state_dict().items())


@torch.no_grad()
def greedy(model: torch.nn.Module, n: int) -> list[int]:
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


@pytest.fixture(scope="module")
def weights_server(start_fake):
    """A server of its own: these tests change its weights."""
    return start_fake("tiny-qwen3", "--decode-delay-s", "0.02", "--ignore-eos")


def make(kind: str, client: SGLangEngine, tmp_path, **kw):
    if kind == "shm":
        return SharedMemoryTransport([client], **kw)
    if kind == "distributed":
        return DistributedTransport([client], backend="gloo", timeout_s=60, **kw)
    return DiskTransport([client], root=tmp_path / "weights", **kw)


@pytest.mark.parametrize("kind", ["shm", "distributed", "disk"])
def test_transport_loads_the_server_model(kind, weights_server, tmp_path):
    seed = 30 + list(ENDPOINTS).index(kind)
    model, named = trainer_weights(seed)
    client = SGLangEngine(weights_server.url)
    before = len(weights_server.state()["updates"])

    async def main():
        tr = make(kind, client, tmp_path, bucket_bytes=512 << 10)
        try:
            await tr.push(named, version=seed)
            return await client.generate(PROMPT, GREEDY)
        finally:
            await tr.close()
            await client.shutdown()
    out = asyncio.run(main())
    assert out.output_ids == greedy(model, GREEDY.max_new_tokens)  # the server samples with the trainer's weights
    assert out.weight_version == seed == client.weight_version == weights_server.state()["weight_version"]
    updates = weights_server.state()["updates"][before:]
    assert {u["endpoint"] for u in updates} == set(ENDPOINTS[kind])
    assert all(u["paused"] for u in updates if u["endpoint"].startswith("update"))


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_weight_update_while_requests_are_in_flight(mode, weights_server, tmp_path):
    """Pause (each mode), load over the disk transport, continue: versions are recorded per span."""
    seed = 40 + ["abort", "retract", "in_place"].index(mode)
    _, named = trainer_weights(seed)
    client = SGLangEngine(weights_server.url)
    old = weights_server.state()["weight_version"]
    sampling = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)

    async def main():
        tr = DiskTransport([client], root=tmp_path / "weights", pause_mode=PauseMode(mode))
        try:
            tasks = [asyncio.ensure_future(client.generate(PROMPT, sampling)) for _ in range(3)]
            start = weights_server.state()["generated_tokens"]
            while weights_server.state()["generated_tokens"] < start + 9:  # every request is mid-way
                await asyncio.sleep(0.01)
            await tr.push(named, version=seed)
            return await asyncio.gather(*tasks)
        finally:
            await client.shutdown()
    outs = asyncio.run(main())
    update = weights_server.state()["updates"][-1]
    assert update["endpoint"] == "update_weights_from_disk" and update["paused"]
    for c in outs:
        if mode == "abort":  # finished at the pause with what they had, all sampled by the old weights
            assert c.finish_reason is FinishReason.ABORT and 0 < len(c.output_ids) < 30
            assert c.meta["weight_versions"] == [(old, 0)] and c.weight_version == old
        else:  # carried on after the update: the first k tokens came from the old weights, the rest the new
            assert c.finish_reason is FinishReason.LENGTH and len(c.output_ids) == 30
            (v0, s0), (v1, k) = c.meta["weight_versions"]
            assert (v0, s0, v1) == (old, 0, seed) and 0 < k < 30
            assert c.weight_version == seed
            assert c.meta["retractions"] == (1 if mode == "retract" else 0)
    if mode == "in_place":
        assert update["running"] == 3  # the requests kept their place (and KV cache) during the load
