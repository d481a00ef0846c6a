"""On-policy distillation's teacher: the student samples episodes with its harness, a teacher engine scores them.

The teacher is a second engine behind the same contract (`miles_agent.engine.Scorer`: SGLang's
``/generate`` with ``max_new_tokens=0`` and input-token logprobs), holding an HF folder given by
``algo.distill_teacher`` -- a previous run's ``final/``, or ``builtin`` for the env's warm start. After
each rollout, the teacher and the student engine score the student's trajectories; the reverse-KL per
sampled token (student minus teacher) becomes per-token advantages (``distill_mode: reward``) or a
loss term in the trainer (``distill_mode: loss``); see `miles_agent.algorithms.distill`.

Both sides of the KL come from one scoring path, so a student identical to its teacher gets exactly 0
(and the engine's sampling numerics do not leak into the signal). The student is scored with the
weights that sampled (the loop scores before the trainer steps) at the rollout temperature, the
teacher at temperature 1 (its own distribution).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from miles_agent import registry
from miles_agent.algorithms import distill as alg
from miles_agent.build import EMBEDDED_ENGINE
from miles_agent.config import Config
from miles_agent.engine import Scorer
from miles_agent.environment import Environment
from miles_agent.errors import UserError
from miles_agent.trainer import TrainBatch
from miles_agent.types import Trajectory

LOSS_MODE_TRAINERS = ("fsdp2", "megatron")  # trainers that add the distillation term to their loss


async def score_responses(engine: Scorer, trajectories: list[Trajectory], temperature: float = 1.0
                          ) -> list[list[float]]:
    """Each trajectory's response tokens scored by ``engine``: one logprob per response position."""
    async def one(t: Trajectory) -> list[float]:
        if not t.response_length:
            return []
        scores = await engine.score(t.tokens, logprob_start_len=len(t.prompt_ids), temperature=temperature)
        return scores.input_token_logprobs

    return list(await asyncio.gather(*(one(t) for t in trajectories)))


class Distiller:
    """Turns a batch's task advantages into distillation targets (see the module docstring)."""

    def __init__(self, teacher: Scorer, student: Scorer, *, mode: str = "reward", coef: float = 1.0,
                 task_coef: float = 1.0, temperature: float = 1.0) -> None:
        self.teacher, self.student = teacher, student
        self.mode = alg.check_mode(mode)
        if coef < 0 or task_coef < 0:
            raise UserError(f"algo.distill_coef and algo.distill_task_coef must be >= 0 (got {coef}, {task_coef})")
        self.coef, self.task_coef, self.temperature = coef, task_coef, temperature

    async def apply(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """The batch to train on, and ``distill/*`` metrics (token means over trainable tokens)."""
        trajs, start = batch.trajectories, time.perf_counter()
        teacher, student = await asyncio.gather(score_responses(self.teacher, trajs, 1.0),
                                                score_responses(self.student, trajs, self.temperature))
        kl = [alg.reverse_kl_tokens(t, s, q) for t, s, q in zip(trajs, student, teacher)]
        metrics = {"distill/reverse_kl": alg.masked_mean(kl, trajs),
                   "distill/teacher_logp": alg.masked_mean(teacher, trajs),
                   "distill/student_logp": alg.masked_mean(student, trajs),
                   "time/distill_scoring": time.perf_counter() - start}
        if self.mode == "reward":
            adv = alg.fold_into_advantages(batch.advantages, kl, coef=self.coef, task_coef=self.task_coef)
            return dataclasses.replace(batch, advantages=adv), metrics  # keeps the driver's old/ref logprobs
        task = [[self.task_coef * a for a in row] for row in batch.advantages]
        return dataclasses.replace(batch, advantages=task, teacher_logprobs=teacher), metrics

    async def shutdown(self) -> None:
        if hasattr(self.teacher, "shutdown"):
            await self.teacher.shutdown()


def teacher_path(cfg: Config, env: Environment) -> Path:
    """The teacher's HF folder: ``builtin`` = the env's warm start (made once, cached)."""
    name = cfg.algo.distill_teacher
    assert name is not None
    if name == "builtin":
        from miles_agent.warmstart import ensure_warm_start

        return ensure_warm_start(env, cfg.model.arch)
    path = Path(name)
    if not (path / "config.json").is_file():
        raise UserError(f"algo.distill_teacher={name!r} is not an HF model folder (no config.json); point it at "
                        "a run's final/ (e.g. train --recipe tiny-sft first) or use algo.distill_teacher=builtin")
    return path


def build_distiller(cfg: Config, env: Environment, tokenizer: Any, student: Any) -> Distiller | None:
    """The run's distiller (with its own teacher engine), or None when ``algo.distill_teacher`` is unset."""
    algo = cfg.algo
    if algo.distill_teacher is None:
        return None
    alg.check_mode(algo.distill_mode)
    if algo.distill_mode == "loss" and cfg.train.backend not in LOSS_MODE_TRAINERS:
        raise UserError(f"algo.distill_mode=loss is applied by the fsdp2 and megatron trainers, not train.backend="
                        f"{cfg.train.backend!r}; use algo.distill_mode=reward (the same gradient at ratio 1)")
    if not isinstance(student, Scorer):
        raise UserError(f"rollout.engine={cfg.rollout.engine!r} cannot score tokens (no `score`), which "
                        f"distillation needs; use rollout.engine={EMBEDDED_ENGINE}")
    from miles_agent.models.builder import load_hf

    model, teacher_tokenizer = load_hf(teacher_path(cfg, env), cfg.model.dtype)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"the teacher {algo.distill_teacher!r} has another tokenizer than the student; "
                        "distillation scores the student's token ids, so both must share one vocabulary")
    one_at_a_time = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_batch_size=1),
                                        algo=dataclasses.replace(algo, true_on_policy=False))
    teacher = registry.load("engines", EMBEDDED_ENGINE)(one_at_a_time, model, teacher_tokenizer)[0]
    return Distiller(teacher, student, mode=algo.distill_mode, coef=algo.distill_coef,
                     task_coef=algo.distill_task_coef, temperature=cfg.rollout.temperature)
