"""On-policy distillation: the reverse-KL signal by hand, exactly zero against itself, and it learns."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_agent.algorithms.distill import distill_loss, fold_into_advantages, reverse_kl_tokens
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny, load_hf
from miles_agent.teacher import Distiller
from miles_agent.trainer import TrainBatch
from miles_agent.types import Trajectory
from miles_agent.warmstart import shipped_path


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads; on shared cores they only add barrier waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def two_turns() -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2])
    t.append_model([3, 4], [-0.1, -0.2], weight_version=0, turn=0)
    t.append_observation([5], turn=0)
    t.append_model([6], [-0.3], weight_version=0, turn=1)
    t.reward = 1.0
    return t


def test_reverse_kl_is_student_minus_teacher_on_trainable_tokens_only():
    t = two_turns()
    t.append_model([7], [-0.1], weight_version=0, turn=2, trainable=False)  # e.g. a span cut by an abort
    kl = reverse_kl_tokens(t, [-1.0, -2.0, -9.0, -0.5, -2.0], [-1.5, -1.0, -3.0, -0.5, -1.0])
    assert kl == [0.5, -1.0, 0.0, 0.0, 0.0]  # the observation token (tool output) carries nothing
    adv = fold_into_advantages([[2.0] * 5], [kl], coef=0.5, task_coef=0.25)
    assert adv == [[0.5 - 0.25, 0.5 + 0.5, 0.5, 0.5, 0.5]]
    with pytest.raises(ValueError, match="3 student / 4 teacher logprobs for 4 response tokens"):
        reverse_kl_tokens(two_turns(), [0.0] * 3, [0.0] * 4)


def test_loss_mode_gradient_is_coef_times_kl_per_token():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = distill_loss(logp, teacher, mask, coef=2.0)
    loss.backward()
    # d/dlogp of coef * mean((logp - q)^2 / 2) over 2 masked tokens = coef * (logp - q) / 2
    assert logp.grad.tolist() == [[0.5, -1.0, 0.0]]
    assert metrics["distill_kl"].item() == pytest.approx((0.5 - 1.0) / 2)
    assert loss.item() == pytest.approx(2.0 * (0.125 + 0.5) / 2)


def test_bad_mode_and_negative_coefficients_are_user_errors():
    with pytest.raises(UserError, match="unknown distillation mode 'fwd'.*algo.distill_mode"):
        Distiller(None, None, mode="fwd")
    with pytest.raises(UserError, match="must be >= 0"):
        Distiller(None, None, coef=-1.0)


# -- with engines ------------------------------------------------------------------------------------

PROMPT = "<|im_start|>user\nWhat is {}?<|im_end|>\n<|im_start|>assistant\n"


def sample(engine: EmbeddedEngine, tokenizer, n: int, seed: int, max_new_tokens: int = 12) -> list[Trajectory]:
    """One-turn trajectories the engine samples for arithmetic prompts."""
    prompts = [tokenizer.encode(PROMPT.format(f"{i}+{2 * i + 1}"), add_special_tokens=False) for i in range(n)]

    async def go():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=max_new_tokens, seed=seed + i))
                                      for i, p in enumerate(prompts)])

    out = []
    for p, c in zip(prompts, asyncio.run(go())):
        t = Trajectory(prompt_ids=p)
        t.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn=0)
        t.reward = 0.0
        out.append(t.validate())
    return out


def test_teacher_equal_to_student_gives_exactly_zero():
    model, tok = build_tiny("tiny-qwen3", seed=3)
    student, teacher = EmbeddedEngine(copy.deepcopy(model), tok), EmbeddedEngine(copy.deepcopy(model), tok)
    trajs = sample(student, tok, 6, seed=0)
    task = [[0.75] * t.response_length for t in trajs]
    batch, metrics = asyncio.run(Distiller(teacher, student, task_coef=1.0).apply(TrainBatch(trajs, task)))
    assert metrics["distill/reverse_kl"] == 0.0
    assert batch.advantages == task  # exactly the task advantages: nothing added
    batch, _ = asyncio.run(Distiller(teacher, student, mode="loss", task_coef=0.5).apply(TrainBatch(trajs, task)))
    assert batch.advantages == [[0.375] * len(row) for row in task]
    assert batch.teacher_logprobs == [(asyncio.run(student.score(t.tokens, logprob_start_len=len(t.prompt_ids)))
                                       ).input_token_logprobs for t in trajs]


def exact_reverse_kl(student, teacher, trajs: list[Trajectory]) -> float:
    """Mean over the batch's sampled positions of the full-vocabulary KL(student || teacher)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.tokens])
            ls = torch.log_softmax(student(input_ids=ids).logits[0, :-1].float(), -1)
            lt = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].float(), -1)
            rows = slice(len(t.prompt_ids) - 1, len(t.tokens) - 1)
            total += float((ls[rows].exp() * (ls[rows] - lt[rows])).sum())
            count += t.response_length
    return total / count


def perturbed_warm_start(noise: float = 0.2):
    """(teacher = the shipped arith-tools warm start, student = it with seeded noise on every weight, tok)."""
    from miles_agent.envs.arith_tools import ArithToolsEnv

    teacher, tok = load_hf(shipped_path(ArithToolsEnv(), "tiny-qwen3"))
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in student.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return teacher, student, tok


def zero_task(trajs: list[Trajectory]) -> TrainBatch:
    return TrainBatch(trajs, [[0.0] * t.response_length for t in trajs])


def test_distillation_steps_reduce_the_reverse_kl_on_a_fixed_batch():
    from miles_agent.trainers.fsdp2 import FSDP2Trainer

    teacher_model, model, tok = perturbed_warm_start()
    student = EmbeddedEngine(copy.deepcopy(model), tok)
    distiller = Distiller(EmbeddedEngine(copy.deepcopy(teacher_model), tok), student, mode="reward", task_coef=0.0)
    trainer = FSDP2Trainer(model, tok, TrainConfig(lr=1e-4), AlgoConfig(distill_teacher="x"))
    fixed = sample(student, tok, 8, seed=100)
    before = exact_reverse_kl(student.model, teacher_model, fixed)
    try:
        for step in range(4):  # on-policy: each step samples fresh episodes from the updated student
            batch, metrics = asyncio.run(distiller.apply(zero_task(sample(student, tok, 8, seed=step * 8))))
            assert metrics["distill/reverse_kl"] > 0
            trainer.train_step(batch)
            asyncio.run(student.update_weights(trainer.named_weights(), version=step + 1))
    finally:
        trainer.close()
    after = exact_reverse_kl(student.model, teacher_model, fixed)
    assert after < 0.75 * before, (before, after)  # measured: 2.04 -> 1.22


def test_reward_and_loss_modes_take_the_same_first_step():
    """At ratio 1 both modes' gradient is coef * kl_t * grad log pi(y_t) (algorithms/distill.py)."""
    from miles_agent.trainers.fsdp2 import FSDP2Trainer

    teacher_model, model, tok = perturbed_warm_start()
    student = EmbeddedEngine(copy.deepcopy(model), tok)
    teacher = EmbeddedEngine(teacher_model, tok)
    trajs = sample(student, tok, 6, seed=7)
    norms = {}
    for mode in ("reward", "loss"):
        batch, _ = asyncio.run(Distiller(teacher, student, mode=mode, task_coef=0.0).apply(zero_task(trajs)))
        trainer = FSDP2Trainer(copy.deepcopy(model), tok, TrainConfig(lr=1e-4),
                               AlgoConfig(distill_teacher="x", distill_mode=mode))
        try:
            out = trainer.train_step(batch)
        finally:
            trainer.close()
        norms[mode] = out["grad_norm"]
        if mode == "loss":
            assert out["distill_kl"] > 0 and out["loss"] == pytest.approx(out["pg_loss"] + out["distill_loss"])
    assert norms["loss"] == pytest.approx(norms["reward"], rel=1e-3)


def test_loss_mode_needs_a_trainer_that_applies_it():
    from miles_agent.config import load_config
    from miles_agent.teacher import build_distiller

    cfg = load_config("tiny-distill", {"train.backend": "my-plugin-trainer", "algo.distill_mode": "loss"})
    with pytest.raises(UserError, match="distill_mode=loss is applied by the fsdp2 and megatron.*distill_mode=reward"):
        build_distiller(cfg, None, None, None)
