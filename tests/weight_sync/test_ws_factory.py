"""``sync`` config -> transport, and the transports over the in-process EmbeddedEngine."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_agent.components import build_transport
from miles_agent.config import load_config
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.transports import (
    DiskTransport,
    InProcessReceiver,
    InProcessTransport,
    SharedMemoryTransport,
    WeightMismatchError,
)


@pytest.fixture(scope="module")
def models():
    engine_model, tok = build_tiny("tiny-qwen3", seed=0)
    trainer_model, _ = build_tiny("tiny-qwen3", seed=1)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.01)
    return engine_model, trainer_model, tok


def _build(overrides, engines, tmp_path):
    cfg = load_config(overrides=[f"run.run_dir={tmp_path}", *overrides])
    return build_transport(cfg, engines)


@pytest.mark.parametrize("kind", ["inprocess", "shm", "disk"])
def test_config_builds_each_transport_over_the_local_engine(kind, models, tmp_path):
    engine_model, trainer_model, tok = models
    engine = EmbeddedEngine(copy.deepcopy(engine_model), tok, max_batch_size=2)
    tr = _build([f"sync.transport={kind}", "sync.check=true", "sync.bucket_mb=1"], [engine], tmp_path)
    expected = {"inprocess": InProcessTransport, "shm": SharedMemoryTransport, "disk": DiskTransport}[kind]
    assert type(tr) is expected and tr.check and tr.bucket_bytes == 1 << 20
    if kind == "disk":
        assert tr.root == tmp_path / "weights" and isinstance(tr.engines[0], InProcessReceiver)

    async def run():
        metrics = await tr.push(trainer_model.state_dict().items(), version=5)
        await engine.shutdown()
        return metrics

    metrics = asyncio.run(run())
    assert engine.weight_version == 5 and metrics["sync_bytes"] > 3e6
    for name, t in trainer_model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name


def test_in_process_check_names_a_tensor_the_engine_did_not_load(models, monkeypatch):
    engine_model, trainer_model, tok = models
    engine = EmbeddedEngine(copy.deepcopy(engine_model), tok, max_batch_size=2)
    load = engine.runner.load_weights
    monkeypatch.setattr(engine.runner, "load_weights",
                        lambda items: load([(n, t) for n, t in items if n != "model.norm.weight"]))
    with pytest.raises(WeightMismatchError, match=r"engine 0 \(in-process\) holds different values for "
                                                  r"'model.norm.weight'"):
        asyncio.run(InProcessTransport([engine], check=True).push(trainer_model.state_dict().items(), version=1))


def test_bad_sync_config_is_a_clear_error(models, tmp_path):
    engine_model, _, tok = models
    engine = EmbeddedEngine(engine_model, tok, max_batch_size=2)
    with pytest.raises(UserError, match=r"unknown weight transport 'nccl' \(sync.transport=nccl\); installed: disk, distributed, inprocess, shm"):
        _build(["sync.transport=nccl"], [engine], tmp_path)
    with pytest.raises(UserError, match="distributed needs engines in their own processes"):
        _build(["sync.transport=distributed"], [engine], tmp_path)
    with pytest.raises(UserError, match="unknown config key 'sync.chek'; did you mean 'sync.check'"):
        load_config(overrides=["sync.chek=true"])
