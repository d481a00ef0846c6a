"""Memory options of the FSDP2 trainer give the same numbers as the plain path: chunked LM head and
log-softmax (values and gradients), varlen packing (no cross-sequence attention), activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainers.batching import build_micro_batch, pack
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.trainers.logprobs import head_logprobs
from tests.trainers.test_fsdp2_trainer import constant_advantages, make_trainer, make_trajectories

ADV = [1.0, -1.0, 0.5, -0.5]


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_matches_the_unchunked_reference_with_gradients(entropy_grad: bool) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    coef = torch.randn(37, generator=g, dtype=torch.float64)
    out = {}
    for chunk in (0, 8, 37, 100):
        logp, ent = head_logprobs(hidden, weight, None, targets, 0.7, chunk, entropy=True, entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad
        loss = (logp * coef).sum() + (ent * coef).sum()
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        out[chunk] = (logp.detach(), ent.detach(), gh, gw)
    ref = torch.log_softmax((hidden @ weight.T) / 0.7, -1)
    assert torch.allclose(out[0][0], ref.gather(-1, targets[:, None])[:, 0], atol=1e-12)
    assert torch.allclose(out[0][1], -(ref.exp() * ref).sum(-1), atol=1e-12)
    for chunk in (8, 37, 100):
        for a, b in zip(out[chunk], out[0]):
            assert torch.allclose(a, b, atol=1e-12, rtol=0)


def trained(trainer: FSDP2Trainer | None = None, **options: object) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Logprobs before the step and the step's gradients (not Adam's update: lr * g / (|g| + eps) turns
    float noise on a near-zero gradient into a full-size difference), of ``trainer`` or one made with
    ``options``."""
    trainer = trainer or make_trainer(micro_batch_tokens=64, **options)
    trajs = make_trajectories(seed=3)
    before = trainer.compute_logprobs(trajs)
    step = trainer.plan_steps(constant_advantages(trajs, ADV))[0]
    trainer.model.train()
    for _ in trainer._backward_micro_batches(step, False):
        pass
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in trainer.model.named_parameters()}
    trainer.close()
    return before, grads


def close(a: tuple, b: tuple, atol: float) -> bool:
    lp = all(abs(x - y) <= atol for ra, rb in zip(a[0], b[0]) for x, y in zip(ra, rb))
    return lp and all(torch.allclose(a[1][k], b[1][k], atol=atol, rtol=1e-4) for k in a[1])


def test_packed_micro_batches_give_the_padded_logprobs_and_update() -> None:
    trajs = make_trajectories(seed=3)
    mb = pack(build_micro_batch(trajs, [0, 1, 2, 3], None, pad_id=0))
    lengths = [len(t.tokens) for t in trajs]
    assert mb.packed_ids.shape == (1, sum(lengths))  # not one pad token
    assert mb.packed_positions[0, lengths[0]].item() == 0  # positions restart at each sequence
    ref = trained(logits_chunk_tokens=0, pack_sequences=False)
    assert close(trained(pack_sequences=True), ref, atol=1e-5)
    assert close(trained(pack_sequences=True, logits_chunk_tokens=5), ref, atol=1e-5)


def test_activation_checkpointing_gives_the_same_update() -> None:
    assert close(trained(activation_checkpointing=True), trained(), atol=1e-6)


def test_memory_options_are_checked() -> None:
    with pytest.raises(UserError, match="pack_sequences"):
        make_trainer(pack_sequences=True, true_on_policy=True)
    with pytest.raises(UserError, match="logits_chunk_tokens"):
        make_trainer(logits_chunk_tokens=-1)
    with pytest.raises(UserError, match="pack_sequences must be auto, true or false"):
        make_trainer(pack_sequences="yes")


def test_auto_packs_unless_true_on_policy() -> None:
    from miles_agent.trainers import varlen

    assert make_trainer().pack and varlen.installed(make_trainer().model)  # the default: auto
    assert not make_trainer(true_on_policy=True).pack  # the engine's kernels, one sequence per row
    assert not make_trainer(pack_sequences=False).pack


def test_the_memory_options_compose_with_bf16_mixed_precision() -> None:
    """All three options on a bf16 model over fp32 masters: the logprobs and gradients of the plain bf16
    path, to bf16's resolution (the chunked head multiplies other row blocks, so roundings differ)."""
    def run(**options: object) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
        model, tok = build_tiny("tiny-qwen3", seed=0)
        return trained(FSDP2Trainer(model.to(torch.bfloat16), tok, TrainConfig(lr=1e-3, micro_batch_tokens=64,
                                                                               **options), AlgoConfig(entropy_coef=0.01)))

    a = run(logits_chunk_tokens=0, pack_sequences=False)
    b = run(logits_chunk_tokens=4, activation_checkpointing=True, pack_sequences=True)
    assert all(g.dtype == torch.float32 for g in b[1].values())
    assert all(abs(x - y) < 3e-2 for ra, rb in zip(a[0], b[0]) for x, y in zip(ra, rb))
    ga, gb = (torch.cat([g[k].reshape(-1) for k in sorted(g)]) for g in (a[1], b[1]))
    assert float(torch.nn.functional.cosine_similarity(ga, gb, dim=0)) > 0.99


def test_chunked_head_backward_with_bias_suppressed_ids_and_frozen_weight() -> None:
    """The hand-written chunked backward (training forwards) against autograd over the whole head."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(29, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (29,), generator=g)
    coef = torch.randn(29, generator=g, dtype=torch.float64)
    suppressed = torch.tensor([41, 45])
    for weight_grad in (True, False):
        weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=weight_grad)
        inputs = (hidden, weight, bias) if weight_grad else (hidden, bias)
        out = []
        for chunk in (0, 6):
            logp, ent = head_logprobs(hidden, weight, bias, targets, 1.3, chunk, entropy=True, suppressed=suppressed)
            out.append((logp.detach(), ent, *torch.autograd.grad((logp * coef).sum(), inputs)))
        for a, b in zip(*out):
            assert torch.allclose(a, b, atol=1e-12, rtol=0)
