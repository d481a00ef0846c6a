"""The FSDP2 trainer on one CPU rank (a single-rank gloo group it creates itself)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny, load_hf
from miles_agent.trainer import TrainBatch, Trainer
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory

PROMPTS = [[11, 12, 13, 14], [21, 22], [31, 32, 33], [41, 42, 43, 44, 45]]


def make_trainer(arch: str = "tiny-qwen3", temperature: float = 1.0, **overrides: object) -> FSDP2Trainer:
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    train = TrainConfig(**{"lr": 1e-3, **{k: v for k, v in overrides.items() if k in train_keys}})
    algo = AlgoConfig(**{k: v for k, v in overrides.items() if k not in train_keys})
    model, tok = build_tiny(arch, seed=0)
    return FSDP2Trainer(model, tok, train, algo, temperature=temperature)


def make_trajectories(trainer: FSDP2Trainer | None = None, seed: int = 0) -> list[Trajectory]:
    """Multi-turn trajectories (model, observation, model spans); rollout logprobs from ``trainer``'s
    policy when given, so the trainer/rollout mismatch is ~0 as with a real engine."""
    rng = random.Random(seed)
    trajs = []
    for i, prompt in enumerate(PROMPTS):
        t = Trajectory(prompt_ids=list(prompt), group_id=str(i % 2))
        t.append_model([rng.randrange(60, 200) for _ in range(3 + i)], [-1.0] * (3 + i), weight_version=0, turn=0)
        t.append_observation([rng.randrange(60, 200) for _ in range(2)], turn=0)
        t.append_model([rng.randrange(60, 200) for _ in range(2)], [-1.0] * 2, weight_version=0, turn=1)
        t.reward = float(i % 2)
        trajs.append(t)
    if trainer is not None:
        for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
            t.rollout_logprobs = lp
    return [t.validate() for t in trajs]


def constant_advantages(trajs: list[Trajectory], values: list[float]) -> TrainBatch:
    return TrainBatch(trajs, [[v] * t.response_length for t, v in zip(trajs, values)])


def weights(trainer: FSDP2Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.named_weights()}


def sampled_logp(logps: list[list[float]], trajs: list[Trajectory]) -> list[float]:
    """Mean logprob of each trajectory's trainable tokens."""
    return [sum(lp * m for lp, m in zip(row, t.loss_mask)) / sum(t.loss_mask) for row, t in zip(logps, trajs)]


def test_is_a_trainer_and_rejects_bad_config() -> None:
    trainer = make_trainer()
    assert isinstance(trainer, Trainer)
    model, tok = build_tiny("tiny-qwen3")
    with pytest.raises(UserError, match="algo.loss"):
        FSDP2Trainer(model, tok, TrainConfig(), AlgoConfig(loss="ppo"))
    with pytest.raises(UserError, match="world_size"):
        FSDP2Trainer(model, tok, TrainConfig(world_size=2), AlgoConfig())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_matches_a_plain_hf_forward(temperature: float) -> None:
    trainer = make_trainer(temperature=temperature, micro_batch_tokens=20)
    trajs = make_trajectories()
    got = trainer.compute_logprobs(trajs)
    ref, _ = build_tiny("tiny-qwen3", seed=0)
    for t, row in zip(trajs, got):
        with torch.no_grad():
            logits = ref(torch.tensor([t.tokens])).logits[0].float() / temperature
        lp = torch.log_softmax(logits, -1)
        p = len(t.prompt_ids)
        want = [float(lp[p + i - 1, tok]) if s else 0.0
                for i, (tok, s) in enumerate(zip(t.response_ids, t._sampled_positions()))]
        assert row == pytest.approx(want, abs=1e-5)


def test_advantage_sign_moves_sampled_logprobs() -> None:
    trainer = make_trainer(lr=3e-3)
    trajs = make_trajectories(trainer)
    before = sampled_logp(trainer.compute_logprobs(trajs), trajs)
    metrics = trainer.train_step(constant_advantages(trajs, [1.0, -1.0, 1.0, -1.0]))
    after = sampled_logp(trainer.compute_logprobs(trajs), trajs)
    assert after[0] > before[0] and after[2] > before[2]
    assert after[1] < before[1] and after[3] < before[3]
    assert metrics["logprob_mismatch_max"] < 1e-5  # rollout logprobs came from the same policy
    assert metrics["tokens"] == sum(sum(t.loss_mask) for t in trajs)
    assert metrics["clipfrac"] == 0.0 and metrics["grad_norm"] > 0 and metrics["lr"] == 3e-3
    assert {"loss", "pg_loss", "entropy", "approx_kl", "logprob_mismatch_mean"} <= set(metrics)


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_micro_batches_accumulate_to_the_full_batch_update(arch: str) -> None:
    trajs = make_trajectories(seed=1)
    batch = constant_advantages(trajs, [1.0, -0.5, 0.25, -1.0])
    results = []
    # sequence lengths 15, 12, 11, 10: one padded micro-batch; [15] [12, 11] [10]; one sequence each
    for budget in (10_000, 24, 1):
        # Adam's first step is ~lr * sign(g), so a gradient at rounding-noise level (|g| ~ 1e-9) moves a
        # weight by a full lr in a direction set by summation order; a larger eps keeps that noise small.
        trainer = make_trainer(arch, micro_batch_tokens=budget, kl_coef=0.1, entropy_coef=0.01, adam_eps=1e-4)
        metrics = trainer.train_step(batch)
        results.append((metrics, weights(trainer)))
    (m1, w1), *others = results
    for m2, w2 in others:
        assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
        for k in w1:
            assert torch.allclose(w1[k], w2[k], atol=1e-5, rtol=0), k


def test_named_weights_are_the_hf_state_dict(tmp_path: Path) -> None:
    trainer = make_trainer()
    fresh, _ = build_tiny("tiny-qwen3", seed=0)
    got = weights(trainer)
    assert list(got) == list(fresh.state_dict())
    for k, v in fresh.state_dict().items():
        assert not isinstance(got[k], DTensor) and torch.equal(got[k], v), k
    trajs = make_trajectories(trainer)
    trainer.train_step(constant_advantages(trajs, [1.0, -1.0, 0.5, 0.0]))
    trainer.save_hf(tmp_path / "hf")
    loaded, _ = load_hf(tmp_path / "hf")
    after = weights(trainer)
    assert not torch.equal(after["model.norm.weight"], got["model.norm.weight"])
    for k, v in loaded.state_dict().items():
        assert torch.equal(after[k], v), k


def _optimizer_state(trainer: FSDP2Trainer) -> list[torch.Tensor]:
    out = []
    for state in trainer.optimizer.state.values():
        for k in sorted(state):
            v = state[k]
            out.append((v.full_tensor() if isinstance(v, DTensor) else v).clone())
    return out


def test_checkpoint_round_trip_restores_exactly(tmp_path: Path) -> None:
    trainer = make_trainer(kl_coef=0.05)
    trajs = make_trajectories(trainer)
    batch = constant_advantages(trajs, [1.0, -1.0, 0.5, -0.5])
    path = tmp_path / "ckpt"
    trainer.train_step(batch)
    trainer.save_checkpoint(path)
    trainer.train_step(batch)
    trainer.save_checkpoint(path)  # replacing an existing checkpoint goes through a temp folder too
    assert path.is_dir() and not path.with_name("ckpt.tmp").exists() and not path.with_name("ckpt.old").exists()
    saved_w, saved_opt, saved_rand = weights(trainer), _optimizer_state(trainer), torch.rand(3)
    assert saved_opt and len(saved_opt) == 3 * len(list(trainer.model.parameters()))
    trainer.train_step(batch)
    next_w = weights(trainer)
    trainer.train_step(batch)
    assert not torch.equal(weights(trainer)["lm_head.weight"], saved_w["lm_head.weight"])
    trainer.load_checkpoint(path)
    assert trainer.step == 2
    for k, v in weights(trainer).items():
        assert torch.equal(v, saved_w[k]), k
    for a, b in zip(_optimizer_state(trainer), saved_opt, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.rand(3), saved_rand)
    trainer.train_step(batch)  # and it continues exactly as it did the first time
    for k, v in weights(trainer).items():
        assert torch.equal(v, next_w[k]), k
    with pytest.raises(UserError, match="not a trainer checkpoint"):
        trainer.load_checkpoint(tmp_path / "nowhere")


def test_sft_loss_decreases_on_a_fixed_batch() -> None:
    trainer = make_trainer(loss="sft", lr=3e-3)
    trajs = make_trajectories(trainer)
    batch = constant_advantages(trajs, [0.0] * len(trajs))
    losses = [trainer.train_step(batch)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in zip(losses, losses[1:]))


def test_old_logprobs_from_a_forward_when_rollout_logprobs_are_off() -> None:
    trainer = make_trainer(use_rollout_logprobs=False, clip_eps=0.01)
    trajs = make_trajectories()  # rollout logprobs are a fake -1.0: far from the policy's
    metrics = trainer.train_step(constant_advantages(trajs, [1.0, -1.0, 1.0, -1.0]))
    assert metrics["clipfrac"] == 0.0 and abs(metrics["approx_kl"]) < 1e-6  # old == current policy
    assert metrics["logprob_mismatch_mean"] > 1.0  # the mismatch is still measured against the rollout
