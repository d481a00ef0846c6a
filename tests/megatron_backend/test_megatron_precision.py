"""Megatron mixed precision on CPU: bf16 model parameters with fp32 main copies (trainers/precision.py).

At lr 1e-6 the fp32 main weights take the step (as in an fp32 run) while plain bf16 parameters round
it away; the step is exactly fp32 AdamW on the fp32-accumulated bf16 gradients; weights leave in bf16;
a checkpoint restores the main weights and the optimizer state exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_helpers import trajectories

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers.megatron.options import MegatronConfig
from miles_agent.trainers.megatron.trainer import MegatronTrainer


def bf16_trainer(**train: object) -> MegatronTrainer:
    model, tok = build_tiny("tiny-qwen3", seed=3)
    cfg = TrainConfig(**{"lr": 1e-6, "grad_clip": 0.0, "micro_batch_tokens": 24, **train})
    return MegatronTrainer(model.to(torch.bfloat16), tok, cfg, AlgoConfig(), megatron=MegatronConfig())


def batch() -> TrainBatch:
    trajs = trajectories()
    return TrainBatch(trajs, [[(1.0 if i % 2 else -0.5)] * t.response_length for i, t in enumerate(trajs)])


def snapshot(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    """The weights the optimizer steps: the fp32 main copies, else the model's own."""
    if trainer.main is not None:
        return {n: m.detach().clone() for n, _, m in trainer.main.named()}
    return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}


def changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(a[n] != b[n]).float().reshape(-1) for n in a]).mean())


def test_fp32_main_weights_take_the_step_where_bf16_parameters_round_it_away(tmp_path: Path) -> None:
    trainer = bf16_trainer()
    try:
        assert all(m.dtype == torch.float32 for m in trainer.main.params())
        before = snapshot(trainer)
        # one step by hand: the fp32 gradients accumulated over micro-batches, then fp32 AdamW
        step = trainer.plan_steps(batch())[0]
        assert len(step.micro_batches) > 1
        trainer.model.train()
        trainer.optimizer.zero_grad(set_to_none=True)
        for _ in trainer._backward_micro_batches(step, False):
            pass
        assert all(p.grad is None for p in trainer.model.parameters())  # folded into the main copies
        grads = {n: m.grad.clone() for n, _, m in trainer.main.named()}
        assert all(g.dtype == torch.float32 for g in grads.values())
        trainer._optimizer_step()
        ref = {n: torch.nn.Parameter(v.clone()) for n, v in before.items()}
        for n, p in ref.items():
            p.grad = grads[n]
        torch.optim.AdamW(ref.values(), lr=1e-6, eps=1e-8).step()
        after = snapshot(trainer)
        assert all(torch.allclose(after[n], ref[n].detach(), rtol=0, atol=1e-12) for n in ref)
        assert changed_fraction(after, before) > 0.95
        assert all(v.dtype == torch.float32 for s in trainer.optimizer.state.values() for k, v in s.items()
                   if k != "step")
        # weights leave in the model's bf16, the main weights rounded
        out = dict(trainer.named_weights())
        assert torch.equal(out["model.norm.weight"], after["decoder.final_layernorm.weight"].to(torch.bfloat16))
        # a checkpoint restores the main weights and moments exactly, and the next step with them
        trainer.save_checkpoint(tmp_path / "ck")
        next_step = trainer.train_step(batch())
        trainer.load_checkpoint(tmp_path / "ck")
        assert all(torch.equal(after[n], v) for n, v in snapshot(trainer).items())
        again = trainer.train_step(batch())
        assert again["loss"] == next_step["loss"] and again["grad_norm"] == next_step["grad_norm"]
    finally:
        trainer.close()
    plain = bf16_trainer(master_dtype="bfloat16")
    try:
        assert plain.main is None
        before = snapshot(plain)
        plain.train_step(batch())
        assert changed_fraction(snapshot(plain), before) < 0.1  # bf16 AdamW at lr 1e-6 stands still
    finally:
        plain.close()


def test_activation_recompute_gives_the_same_gradients_and_packing_is_refused() -> None:
    def grads(**train: object) -> dict[str, torch.Tensor]:
        model, tok = build_tiny("tiny-qwen3", seed=3)
        trainer = MegatronTrainer(model, tok, TrainConfig(micro_batch_tokens=24, **train), AlgoConfig(),
                                  megatron=MegatronConfig())
        try:
            assert trainer.model.config.recompute_granularity == ("full" if train else None)
            step = trainer.plan_steps(batch())[0]
            trainer.model.train()
            for _ in trainer._backward_micro_batches(step, False):
                pass
            return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        finally:
            trainer.close()

    plain, recomputed = grads(), grads(activation_checkpointing=True)
    assert all(torch.equal(plain[n], recomputed[n]) for n in plain)
    model, tok = build_tiny("tiny-qwen3", seed=3)
    with pytest.raises(UserError, match="pack_sequences"):
        MegatronTrainer(model, tok, TrainConfig(pack_sequences=True), AlgoConfig(), megatron=MegatronConfig())
