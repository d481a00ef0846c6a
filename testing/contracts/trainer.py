"""The trainer contract (``miles_agent.trainer.Trainer``): what the loop, SFT, the batch builder and weight
sync rely on, checked on a tiny model built from config, in one process.

Provide ``trainer_class``: a callable ``(model, tokenizer, train, algo, *, temperature, **trainer_kwargs)``
(a ``train.backend`` plug-in is exactly that). Optional: ``trainer_kwargs`` (dict), ``model_arch``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.engine import SamplingParams
from miles_agent.testing.contracts._fixtures import fixture_missing
from miles_agent.trainer import OffloadableTrainer, TrainBatch, Trainer
from miles_agent.types import Trajectory

PROMPTS = ([5, 17, 33, 60, 72], [9, 41, 12], [80, 3, 3, 27, 54, 61, 90])


def tiny_batch(vocab: int = 100) -> TrainBatch:
    """Three trajectories with a sampled span, an observation and another sampled span; advantages of
    both signs, so any policy-gradient loss has a gradient."""
    trajs = []
    for i, prompt in enumerate(PROMPTS):
        t = Trajectory(prompt_ids=list(prompt), group_id="g0", uid=f"contract-{i}")
        t.append_model([(7 * i + k) % vocab for k in range(1, 5)], [-1.5] * 4, weight_version=0, turn=0)
        t.append_observation([11, 12], turn=1)
        t.append_model([(13 * i + k) % vocab for k in range(2, 5)], [-2.0] * 3, weight_version=0, turn=1)
        t.reward = float(i % 2)
        trajs.append(t.validate())
    adv = [[(1.0 if i % 2 else -1.0)] * t.response_length for i, t in enumerate(trajs)]
    return TrainBatch(trajs, adv)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in trainer.named_weights()}


def trainer_factory(trainer_class: Callable[..., Trainer], kwargs: dict[str, Any], arch: str = "tiny-qwen3",
                    seed: int = 0) -> tuple[Callable[..., Trainer], list[Trainer]]:
    """``make(**algo)`` building trainers on fresh tiny models, and the list of those built (to close)."""
    from miles_agent.models.builder import build_tiny

    built: list[Trainer] = []

    def make(**algo: Any) -> Trainer:
        model, tok = build_tiny(arch, seed=seed)
        train = TrainConfig(lr=1e-2, micro_batch_tokens=32)
        built.append(trainer_class(model, tok, train, AlgoConfig(**algo), temperature=1.0, **kwargs))
        return built[-1]

    return make, built


class TrainerContract:
    model_arch = "tiny-qwen3"
    seed = 0

    @pytest.fixture
    def trainer_class(self) -> Callable[..., Trainer]:
        fixture_missing("TrainerContract", "trainer_class", "the Trainer class")

    @pytest.fixture
    def trainer_kwargs(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def make_trainer(self, trainer_class, trainer_kwargs) -> Iterator[Callable[..., Trainer]]:
        """Builds trainers on fresh tiny models (``algo`` overrides as keywords); closes them all after."""
        make, built = trainer_factory(trainer_class, trainer_kwargs, self.model_arch, self.seed)
        yield make
        for t in built[::-1]:
            t.close()

    def test_satisfies_the_protocol(self, make_trainer) -> None:
        trainer = make_trainer()
        missing = [m for m in ("train_step", "compute_logprobs", "named_weights", "save_checkpoint",
                               "load_checkpoint", "save_hf", "close") if not callable(getattr(trainer, m, None))]
        assert not missing, f"{type(trainer).__name__} lacks {missing}"
        assert isinstance(trainer, Trainer), "rank, device and on_micro_batch are part of the Trainer protocol"

    def test_train_step_returns_finite_loss_and_changes_the_weights(self, make_trainer) -> None:
        trainer = make_trainer()
        before = weights(trainer)
        calls: list[tuple[int, int]] = []
        trainer.on_micro_batch = lambda done, total: calls.append((done, total))
        metrics = trainer.train_step(tiny_batch())
        for key in ("loss", "grad_norm", "lr"):
            assert key in metrics and math.isfinite(metrics[key]), f"metric {key!r} missing or not finite: {metrics}"
        after = weights(trainer)
        assert set(after) == set(before), "train_step changed the set of weight names"
        moved = [k for k in before if not torch.equal(before[k], after[k])]
        assert moved, "train_step left every weight unchanged"
        assert calls and calls[-1][0] == calls[-1][1], f"on_micro_batch was not driven to completion: {calls}"

    def test_compute_logprobs_match_the_engine(self, make_trainer) -> None:
        """The trainer's logprobs of tokens an engine with the same weights sampled are the engine's."""
        from miles_agent.engines.embedded.engine import EmbeddedEngine
        from miles_agent.models.builder import build_tiny

        trainer = make_trainer()
        model, tok = build_tiny(self.model_arch, seed=self.seed)
        engine = EmbeddedEngine(model, tok)
        t = Trajectory(prompt_ids=list(PROMPTS[0]))
        out = asyncio.run(engine.generate(t.prompt_ids, SamplingParams(max_new_tokens=8, seed=1)))
        t.append_model(out.output_ids, out.output_logprobs, weight_version=0, turn=0)
        t.reward = 0.0
        (row,) = trainer.compute_logprobs([t.validate()])
        assert len(row) == t.response_length, "one logprob per response token"
        mine = [lp for lp, m in zip(row, t.loss_mask) if m]
        assert mine == pytest.approx(out.output_logprobs, abs=1e-3), "trainer and engine logprobs differ"

    def test_reference_logprobs_need_a_reference_model(self, make_trainer) -> None:
        with pytest.raises(ValueError):
            make_trainer().compute_logprobs(tiny_batch().trajectories, reference=True)

    def test_named_weights_are_full_tensors_under_engine_names(self, make_trainer) -> None:
        from miles_agent.models.builder import build_tiny

        engine_state = build_tiny(self.model_arch, seed=self.seed)[0].state_dict()
        mine = weights(make_trainer())
        unknown = sorted(set(mine) - set(engine_state))
        assert not unknown, f"named_weights yields names the engine does not have: {unknown[:3]}"
        for k, v in mine.items():
            assert v.shape == engine_state[k].shape, f"{k}: {tuple(v.shape)} is not the full {engine_state[k].shape}"
            assert torch.equal(v, engine_state[k]), f"{k}: the untrained weights are not the model's"

    def test_save_then_load_restores_identical_weights(self, make_trainer, tmp_path: Path) -> None:
        trainer = make_trainer()
        trainer.save_checkpoint(tmp_path / "ckpt")
        saved = weights(trainer)
        trainer.train_step(tiny_batch())
        stepped = weights(trainer)
        assert any(not torch.equal(saved[k], stepped[k]) for k in saved), "train_step left every weight unchanged"
        trainer.load_checkpoint(tmp_path / "ckpt")
        restored = weights(trainer)
        differ = [k for k in saved if not torch.equal(saved[k], restored[k])]
        assert not differ, f"load_checkpoint did not restore {differ[:3]} (and {max(len(differ) - 3, 0)} more)"
        trainer.train_step(tiny_batch())  # the optimizer state came back too: the same step again
        again = weights(trainer)
        differ = [k for k in stepped if not torch.allclose(stepped[k], again[k], rtol=1e-5, atol=1e-7)]
        assert not differ, f"a step after load_checkpoint differs from the step after save at {differ[:3]}"

    def test_offload_then_reload_gives_back_the_same_trainer(self, make_trainer) -> None:
        """Only for trainers that can offload (``OffloadableTrainer``, ``train.offload``)."""
        trainer = make_trainer()
        if not isinstance(trainer, OffloadableTrainer):
            pytest.skip(f"{type(trainer).__name__} does not offload")
        before = weights(trainer)
        trainer.offload()
        assert trainer.memory.offloaded and trainer.memory.resident_bytes() == 0, "offload kept device memory"
        trainer.reload()
        assert not trainer.memory.offloaded
        after = weights(trainer)
        assert all(torch.equal(before[k], after[k]) for k in before), "reload did not restore the weights bit for bit"
        assert math.isfinite(trainer.train_step(tiny_batch())["loss"]), "no step after reload"
