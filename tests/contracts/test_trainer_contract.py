"""The trainer contract against FSDP2 and Megatron (CPU), and against trainers broken on purpose."""

from __future__ import annotations

import pytest

from miles_agent.testing.contracts import TrainerContract
from miles_agent.testing.contracts.trainer import trainer_factory
from miles_agent.trainers.fsdp2 import FSDP2Trainer


class TestFSDP2Trainer(TrainerContract):
    @pytest.fixture
    def trainer_class(self):
        return FSDP2Trainer


class TestMegatronTrainer(TrainerContract):
    @pytest.fixture
    def trainer_class(self):
        pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
        from miles_agent.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer


class FrozenTrainer(FSDP2Trainer):
    """Computes the loss and gradients but never steps: train_step leaves the weights as they were."""

    def _optimizer_step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return 0.0


class ForgetfulTrainer(FSDP2Trainer):
    """Writes checkpoints but loads nothing back."""

    def load_checkpoint(self, path) -> None:
        pass


def run_contract(trainer_class, check: str, *args) -> None:
    make, built = trainer_factory(trainer_class, {})
    try:
        getattr(TrainerContract(), check)(make, *args)
    finally:
        for t in built:
            t.close()


def test_a_trainer_that_never_steps_fails_the_contract():
    with pytest.raises(AssertionError, match="left every weight unchanged"):
        run_contract(FrozenTrainer, "test_train_step_returns_finite_loss_and_changes_the_weights")


def test_a_trainer_that_does_not_load_its_checkpoint_fails_the_contract(tmp_path):
    with pytest.raises(AssertionError, match="load_checkpoint did not restore"):
        run_contract(ForgetfulTrainer, "test_save_then_load_restores_identical_weights", tmp_path)


def test_a_trainer_off_by_one_temperature_fails_the_logprob_check():
    def hot(model, tok, train, algo, *, temperature, **kw):
        return FSDP2Trainer(model, tok, train, algo, temperature=temperature * 2, **kw)

    with pytest.raises(AssertionError, match="trainer and engine logprobs differ"):
        run_contract(hot, "test_compute_logprobs_match_the_engine")
