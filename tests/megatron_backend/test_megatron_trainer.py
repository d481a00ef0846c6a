"""The Megatron trainer computes what the FSDP2 trainer computes: same logprobs, same loss, same update
(Megatron-core layers run on CPU through trainers/megatron/cpu_compat.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron_helpers import trajectories

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny, load_hf
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.trainers.megatron.options import MegatronConfig
from miles_agent.trainers.megatron.trainer import MegatronTrainer


@pytest.fixture
def pair():
    """(FSDP2 trainer, Megatron trainer) from the same tiny MoE weights; torn down after the test."""
    # adam_eps=1 keeps the first Adam step proportional to the gradient (with a tiny eps it is ~sign(g),
    # which turns float noise in near-zero gradients into full-size differences).
    train = TrainConfig(lr=0.1, adam_eps=1.0, micro_batch_tokens=24)
    algo = AlgoConfig(entropy_coef=0.01)
    trainers = []
    try:
        model, tok = build_tiny("tiny-qwen3-moe", seed=3)
        megatron = MegatronTrainer(model, tok, train, algo, temperature=0.8, megatron=MegatronConfig())
        trainers.append(megatron)
        model, tok = build_tiny("tiny-qwen3-moe", seed=3)
        trainers.insert(0, FSDP2Trainer(model, tok, train, algo, temperature=0.8))
        yield trainers
    finally:
        for t in trainers[::-1]:
            t.close()
        assert not dist.is_initialized()


def test_same_logprobs_loss_and_update_as_fsdp2(pair):
    fsdp, meg = pair
    trajs = trajectories()
    for a, b in zip(fsdp.compute_logprobs(trajs), meg.compute_logprobs(trajs)):
        assert a == pytest.approx(b, abs=2e-5)
    adv = [[(1.0 if i % 2 else -0.5)] * t.response_length for i, t in enumerate(trajs)]
    m1 = fsdp.train_step(TrainBatch(trajs, adv))
    m2 = meg.train_step(TrainBatch(trajs, adv))
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "tokens"):
        if k in m1:
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    w1, w2 = dict(fsdp.named_weights()), dict(meg.named_weights())
    assert set(w1) == set(w2)
    moved = 0
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)
        moved += int(not torch.equal(w2[k], build_tiny_weights()[k]))
    assert moved > len(w1) // 2  # the step really changed the weights, identically


_initial: dict[str, torch.Tensor] = {}


def build_tiny_weights() -> dict[str, torch.Tensor]:
    if not _initial:
        _initial.update(build_tiny("tiny-qwen3-moe", seed=3)[0].state_dict())
    return _initial


def test_save_hf_and_checkpoint_round_trip(pair, tmp_path):
    _, meg = pair
    trajs = trajectories()
    adv = [[1.0] * t.response_length for t in trajs]
    meg.train_step(TrainBatch(trajs, adv))
    meg.save_checkpoint(tmp_path / "ckpt")
    after_one = {k: v.clone() for k, v in meg.named_weights()}
    meg.save_hf(tmp_path / "hf")
    reloaded, _ = load_hf(tmp_path / "hf")
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, after_one[k]), k
    first = meg.train_step(TrainBatch(trajs, adv))
    meg.load_checkpoint(tmp_path / "ckpt")
    again = meg.train_step(TrainBatch(trajs, adv))
    assert again["loss"] == first["loss"] and again["grad_norm"] == first["grad_norm"]


def test_unwired_layouts_are_refused_clearly():
    model, tok = build_tiny("tiny-qwen3", seed=0)
    with pytest.raises(UserError, match="context_parallel"):
        MegatronTrainer(model, tok, TrainConfig(), AlgoConfig(), megatron=MegatronConfig(context_parallel=2))
    model, tok = build_tiny("tiny-qwen3-moe", seed=0)
    with pytest.raises(UserError, match="alltoall token dispatcher"):
        MegatronTrainer(model, tok, TrainConfig(world_size=2), AlgoConfig(),
                        megatron=MegatronConfig(pipeline_parallel=2))
    assert not dist.is_initialized()


def test_offload_round_trip_frees_the_state_and_restores_it_bit_for_bit(pair):
    """Colocation: the Megatron trainer offloads with the same storage-level mechanism as FSDP2
    (trainers/offload.py); between two steps its state holds 0 bytes and comes back bit for bit."""
    fsdp, meg = pair
    trajs = trajectories()
    adv = [[(1.0 if t.reward else -0.5)] * t.response_length for t in trajs]
    meg.train_step(TrainBatch(trajs, adv))
    resident = meg.memory.resident_bytes()
    before = {k: v.clone() for k, v in meg.named_weights()}
    assert meg.offload()["offload_bytes"] == resident > 0 and meg.memory.resident_bytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in meg.model.parameters())
    meg.reload()
    assert all(torch.equal(v, before[k]) for k, v in meg.named_weights())
    second = meg.train_step(TrainBatch(trajs, adv))
    assert second["loss"] == second["loss"] and meg.memory.resident_bytes() == resident
