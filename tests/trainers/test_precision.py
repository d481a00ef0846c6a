"""Mixed precision on CPU: fp32 master weights and optimizer state under a bf16 model (bf16 compute).

The contrast that matters: at the recipes' lr (1e-6) plain bf16 AdamW rounds almost every update away
(an update below half a bf16 ulp of its weight, ~2^-9 relative, is lost), while the fp32 masters take
each step as an fp32 run does.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from tests.trainers.test_fsdp2_trainer import constant_advantages, make_trajectories

ADV = [1.0, -1.0, 0.5, -0.5]


def bf16_model():  # noqa: ANN201
    model, tok = build_tiny("tiny-qwen3", seed=0)
    return model.to(torch.bfloat16), tok


def trainer_for(model, tok, **train: object) -> FSDP2Trainer:  # noqa: ANN001
    return FSDP2Trainer(model, tok, TrainConfig(**{"lr": 1e-6, "grad_clip": 0.0, **train}), AlgoConfig())


def masters(trainer: FSDP2Trainer) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in trainer.model.named_parameters()}


def updates(trainer: FSDP2Trainer, steps: int = 2) -> dict[str, torch.Tensor]:
    before = masters(trainer)
    batch = constant_advantages(make_trajectories(seed=1), ADV)
    for _ in range(steps):
        trainer.train_step(batch)
    after = masters(trainer)
    trainer.close()
    return {n: after[n] - before[n] for n in before}


def flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in d.values()])


def grads(trainer: FSDP2Trainer) -> dict[str, torch.Tensor]:
    """One optimizer step's accumulated gradients (not stepped)."""
    step = trainer.plan_steps(constant_advantages(make_trajectories(seed=1), ADV))[0]
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    for _ in trainer._backward_micro_batches(step, False):
        pass
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in trainer.model.named_parameters()}


def test_the_mixed_step_is_fp32_adamw_on_the_bf16_gradient() -> None:
    """Exact semantics: bf16 forward and backward (bit-identical to a bf16 model's), the gradient
    reduced in fp32, and fp32 AdamW on the fp32 masters."""
    model, tok = bf16_model()
    plain = trainer_for(copy.deepcopy(model), tok, master_dtype="bfloat16")
    g_bf16 = grads(plain)
    plain.close()
    mixed = trainer_for(copy.deepcopy(model), tok)
    before = masters(mixed)
    g = grads(mixed)
    assert all(g[n].dtype == torch.float32 and torch.equal(g[n], g_bf16[n].float()) for n in g)
    mixed._optimizer_step()
    ref = {n: torch.nn.Parameter(v.clone()) for n, v in before.items()}
    for n, p in ref.items():
        p.grad = g[n]
    torch.optim.AdamW(ref.values(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    after = masters(mixed)
    assert all(torch.allclose(after[n], ref[n].detach(), rtol=0, atol=1e-12) for n in ref)
    mixed.close()


def test_bf16_compute_over_fp32_masters_updates_like_fp32_where_plain_bf16_stands_still() -> None:
    model, tok = bf16_model()
    fp32 = flat(updates(trainer_for(copy.deepcopy(model).float(), tok)))  # the same (bf16-exact) start
    mixed_trainer = trainer_for(copy.deepcopy(model), tok)
    assert all(p.dtype == torch.float32 for p in mixed_trainer.model.parameters())  # fp32 masters
    mixed = flat(updates(mixed_trainer))
    plain = flat(updates(trainer_for(copy.deepcopy(model), tok, master_dtype="bfloat16")))

    changed = {k: float((v != 0).float().mean()) for k, v in (("fp32", fp32), ("mixed", mixed), ("plain", plain))}
    assert changed["fp32"] > 0.95 and changed["mixed"] > 0.95, changed
    assert changed["plain"] < 0.1, changed  # bf16 AdamW at lr 1e-6: the updates round away
    # Adam's first steps move each weight by ~lr * sign(grad): the size of the update is fixed by lr, and
    # bf16 compute changes only the direction of gradients that its rounding (2^-8 relative per op, large
    # against a near-uniform softmax's p - onehot) flips. Measured over 2 steps: norm ratio 1.01, cosine
    # 0.957, sign agreement 96.7% (the gradients themselves: cosine 0.98). Bounds with margin below.
    cos = float(torch.nn.functional.cosine_similarity(mixed, fp32, dim=0))
    agree = float((mixed.sign() == fp32.sign()).float().mean())
    ratio = float(mixed.norm() / fp32.norm())
    assert cos > 0.9 and agree > 0.93 and abs(ratio - 1) < 0.05, (cos, agree, ratio)
    plain_cos = float(torch.nn.functional.cosine_similarity(plain, fp32, dim=0))
    assert float(plain.norm() / fp32.norm()) < 0.5 and plain_cos < 0.5, plain_cos


def test_weights_leave_in_the_compute_dtype_and_logprobs_are_fp32() -> None:
    model, tok = bf16_model()
    plain = copy.deepcopy(model)
    trainer = trainer_for(model, tok)
    trajs = make_trajectories(seed=1)
    got = trainer.compute_logprobs(trajs)
    for t, row in zip(trajs, got):  # the bf16 forward's logits, log-softmax in fp32
        with torch.no_grad():
            logits = plain(torch.tensor([t.tokens])).logits[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(t.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)  # the model's tokens
        assert torch.allclose(torch.tensor(row)[mask], want[-t.response_length:][mask], atol=2e-2)
    trainer.train_step(constant_advantages(trajs, ADV))
    out = dict(trainer.named_weights())
    ms = masters(trainer)
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    assert torch.equal(out["model.norm.weight"], ms["model.norm.weight"].to(torch.bfloat16))
    trainer.close()


def test_checkpoint_restores_fp32_masters_and_optimizer_state_exactly(tmp_path: Path) -> None:
    model, tok = bf16_model()
    trainer = trainer_for(model, tok)
    batch = constant_advantages(make_trajectories(seed=1), ADV)
    trainer.train_step(batch)
    trainer.save_checkpoint(tmp_path / "ck")
    saved, saved_opt = masters(trainer), copy.deepcopy(trainer.optimizer.state_dict()["state"])
    trainer.train_step(batch)
    after_one_more = masters(trainer)
    trainer.load_checkpoint(tmp_path / "ck")
    restored = masters(trainer)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    state = trainer.optimizer.state_dict()["state"]
    for k, s in saved_opt.items():
        for name, v in s.items():
            got = state[k][name]
            got = got.full_tensor() if isinstance(got, DTensor) else got
            v = v.full_tensor() if isinstance(v, DTensor) else v
            assert got.dtype == v.dtype and torch.equal(got, v), (k, name)
    assert all(v.dtype == torch.float32 for s in state.values() for n, v in s.items() if n != "step")
    trainer.train_step(batch)
    assert all(torch.equal(after_one_more[k], masters(trainer)[k]) for k in saved)  # resume is exact
    trainer.close()


def test_precision_options_are_checked() -> None:
    model, tok = build_tiny("tiny-qwen3", seed=0)
    with pytest.raises(UserError, match="narrower"):
        trainer_for(model, tok, master_dtype="bfloat16")  # an fp32 model over bf16 masters
    with pytest.raises(UserError, match="master_dtype"):
        trainer_for(model, tok, master_dtype="fp32")
    with pytest.raises(UserError, match="loss scaling"):
        trainer_for(model.to(torch.float16), tok)


def test_bf16_sft_loss_falls_like_fp32() -> None:
    """The fast learning check: a few SFT steps on a fixed batch at a real rate."""
    model, tok = bf16_model()
    losses = {}
    for name, m in (("fp32", copy.deepcopy(model).float()), ("mixed", copy.deepcopy(model))):
        trainer = FSDP2Trainer(m, tok, dataclasses.replace(TrainConfig(), lr=1e-3), AlgoConfig(loss="sft"))
        batch = constant_advantages(make_trajectories(seed=2), [1.0] * 4)
        losses[name] = [trainer.train_step(batch)["loss"] for _ in range(6)]
        trainer.close()
    assert losses["mixed"][-1] < 0.8 * losses["mixed"][0], losses
    assert abs(losses["mixed"][-1] - losses["fp32"][-1]) < 0.05 * losses["fp32"][0], losses
