"""The trainer contract against FSDP2 and Megatron (CPU), a minimal third backend built on PolicyTrainer,
and trainers broken on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_agent.models.builder import save_hf
from miles_agent.testing.contracts import TrainerContract
from miles_agent.testing.contracts.trainer import trainer_factory
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.trainers.policy_trainer import PolicyTrainer, local_grad_norm


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


class PlainTrainer(PolicyTrainer):
    """A third backend: one process, no sharding, no process group. The step is PolicyTrainer's; this is
    only the five hooks and the weights' way in and out."""

    def __init__(self, model, tokenizer, train, algo, *, temperature=1.0):
        super().__init__(tokenizer, train, algo, temperature)
        self.device, self.rank, self.dp_rank, self.dp_size = torch.device("cpu"), 0, 0, 1
        self.model, self.ref_model = model, None
        self._init_optimizer()

    def _forward_logprobs(self, model, mb, entropy=False, entropy_grad=False):
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=mb.keep, use_cache=False)
        logp_all = torch.log_softmax(out.logits[:, :-1].float() / self.temperature, dim=-1)
        ent = None
        if entropy:
            src = logp_all if entropy_grad else logp_all.detach()
            ent = -(src.exp() * src).sum(-1)
        return logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1), ent

    def _backward(self, loss):
        loss.backward()

    def _reduce_grads(self):
        pass  # one process: the gradients are complete

    def _grad_norm(self):
        return local_grad_norm(list(self.model.parameters()))

    def _dp_group(self):
        return None

    def named_weights(self):
        yield from self.model.state_dict().items()

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True)
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "step": self.step},
                   Path(path) / "state.pt")

    def load_checkpoint(self, path):
        state = torch.load(Path(path) / "state.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step = state["step"]

    def save_hf(self, path):
        save_hf(self.model, self.tokenizer, path)

    def close(self):
        pass


class TestPlainTrainer(TrainerContract):
    @pytest.fixture
    def trainer_class(self):
        return PlainTrainer


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
