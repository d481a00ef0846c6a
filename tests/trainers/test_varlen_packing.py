"""Varlen packing (``train.pack_sequences``): a micro-batch's sequences in one row, no pad token computed,
attention per sequence (``trainers/varlen.py``) -- and the same per-token logprobs, gradients, loss masks
and R3 routing as the padded path, on ragged batches of the tiny dense Qwen3 and the tiny Qwen3 MoE."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainer import TrainBatch
from miles_agent.trainers import routing_replay, varlen
from miles_agent.trainers.batching import build_micro_batch, pack, pack_micro_batches
from miles_agent.trainers.fsdp2 import FSDP2Trainer
from miles_agent.types import Trajectory
from tests.trainers.test_fsdp2_trainer import make_trainer

# (prompt, first reply, observation, second reply) lengths: ragged, with two pairs of equal totals
SHAPES = [(4, 6, 2, 3), (2, 3, 0, 0), (7, 2, 3, 3), (3, 5, 2, 5), (5, 4, 0, 0), (2, 3, 0, 0)]


def ragged_trajectories(seed: int = 0, moe_layers: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i, (p, a, o, b) in enumerate(SHAPES):
        t = Trajectory(prompt_ids=[rng.randrange(3, 250) for _ in range(p)], group_id=str(i % 3))
        t.append_model([rng.randrange(60, 200) for _ in range(a)], [-1.0] * a, weight_version=0, turn=0)
        if o:
            t.append_observation([rng.randrange(60, 200) for _ in range(o)], turn=0)
            t.append_model([rng.randrange(60, 200) for _ in range(b)], [-1.0] * b, weight_version=0, turn=1)
        if moe_layers:  # forced routing, far from the natural one
            ids = np.array([[rng.sample(range(8), 2) for _ in range(moe_layers)] for _ in range(len(t.tokens) - 1)])
            t.routed_experts = ids.astype("int32")
        t.reward = float(i % 2)
        out.append(t.validate())
    return out


def logprobs_and_grads(trainer: FSDP2Trainer, trajs: list[Trajectory]) -> tuple[list[list[float]], dict]:
    logps = trainer.compute_logprobs(trajs)
    batch = TrainBatch(trajs, [[1.0 - 0.4 * i] * t.response_length for i, t in enumerate(trajs)])
    step = trainer.plan_steps(batch)[0]
    trainer.model.train()
    for _ in trainer._backward_micro_batches(step, False):
        pass
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logps, grads


def assert_same(a: tuple, b: tuple, atol: float = 1e-5) -> None:
    for ra, rb in zip(a[0], b[0]):
        assert len(ra) == len(rb) and max((abs(x - y) for x, y in zip(ra, rb)), default=0.0) <= atol
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.allclose(a[1][k], b[1][k], atol=atol, rtol=1e-4), k


def test_segments_group_consecutive_equal_lengths() -> None:
    seg = varlen.Segments.of([5, 5, 3, 3, 3, 7])
    assert seg.runs == ((0, 2, 5), (10, 3, 3), (19, 1, 7))
    assert seg.total == 26


def test_a_packed_micro_batch_budget_counts_real_tokens() -> None:
    lengths = [10, 4, 4, 3, 9]
    assert pack_micro_batches(range(5), lengths, 20) == [[0, 4], [1, 2, 3]]  # padded: rows * longest
    assert pack_micro_batches(range(5), lengths, 20, packed=True) == [[0, 4], [1, 2, 3]]
    assert pack_micro_batches(range(5), lengths, 30, packed=True) == [[0, 4, 1, 2, 3]]  # 30 real, 50 padded
    assert pack_micro_batches(range(5), lengths, 30) == [[0, 4, 1], [2, 3]]


def test_varlen_attention_equals_a_block_diagonal_mask_with_gradients() -> None:
    """GQA (4 query heads over 2 KV heads), float64: values and gradients of q, k, v."""
    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    g = torch.Generator().manual_seed(0)
    lengths = [6, 6, 4, 9, 1]
    t = sum(lengths)
    q = torch.randn(1, 4, t, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, t, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(1, t, 4, 8, generator=g, dtype=torch.float64)
    out, _ = varlen.attention(Module(), q, k, v, None, varlen=varlen.Segments.of(lengths), scaling=0.3)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    mask = (seq[:, None] == seq[None]) & (pos[:, None] >= pos[None])
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask,
                                         scale=0.3).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-12)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, want))


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_packed_path_gives_the_padded_logprobs_gradients_and_masks(arch: str, monkeypatch) -> None:
    trajs = ragged_trajectories()
    padded = make_trainer(arch, micro_batch_tokens=48, pack_sequences=False)
    ref = logprobs_and_grads(padded, trajs)
    ref_mbs = padded.plan_steps(TrainBatch(trajs, [[1.0] * t.response_length for t in trajs]))[0].micro_batches
    padded.close()

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):  # noqa: ANN001, ANN202
        calls.append((q.shape[0], q.shape[2], attn_mask is None, kw.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    packed = make_trainer(arch, micro_batch_tokens=48, pack_sequences=True)
    assert varlen.installed(packed.model)
    got = logprobs_and_grads(packed, trajs)
    mbs = packed.plan_steps(TrainBatch(trajs, [[1.0] * t.response_length for t in trajs]))[0].micro_batches
    packed.close()
    assert_same(got, ref)
    assert len(mbs) == len(ref_mbs) > 1
    for mb, r in zip(mbs, ref_mbs):  # the loss reads the very same grid
        assert mb.indices == r.indices
        for name in ("loss_mask", "advantages", "rollout_logp", "targets", "sampled"):
            assert torch.equal(getattr(mb, name), getattr(r, name)), name
        lengths = [len(trajs[i].tokens) for i in mb.indices]
        assert mb.packed_ids.shape == (1, sum(lengths)) and mb.packed_lengths == lengths  # not one pad token
    # every attention call of the packed trainer ran per sequence: causal SDPA without a [T, T] mask
    assert calls and all(no_mask and causal for _, _, no_mask, causal in calls)
    assert max(t for _, t, _, _ in calls) == max(len(t.tokens) for t in trajs)


def test_routing_replay_rows_follow_the_packed_layout() -> None:
    """R3 with packing: each packed token is routed to the experts its own padded row replays."""
    model, _ = build_tiny("tiny-qwen3-moe", seed=0)
    trajs = ragged_trajectories(seed=1, moe_layers=len(routing_replay.moe_routers(model)))
    runs = {}
    for pack_sequences in (False, True):
        trainer = make_trainer("tiny-qwen3-moe", micro_batch_tokens=48, routing_replay=True,
                               pack_sequences=pack_sequences)
        runs[pack_sequences] = logprobs_and_grads(trainer, trajs)
        mbs = trainer._build_micro_batches(trajs, [[0, 3, 2]], None)
        trainer.close()
    mb = mbs[0]
    assert mb.routed_experts.shape[:2] == (1, sum(len(trajs[i].tokens) for i in (0, 3, 2)))
    for b, i in enumerate(mb.indices):
        start, n = sum(mb.packed_lengths[:b]), len(trajs[i].tokens)
        assert torch.equal(mb.routed_experts[0, start:start + n - 1], torch.as_tensor(trajs[i].routed_experts).long())
        assert (mb.routed_experts[0, start + n - 1] == -1).all()  # a row's last token: its own routing
    assert_same(runs[True], runs[False])
    natural = make_trainer("tiny-qwen3-moe", micro_batch_tokens=48, pack_sequences=True)
    assert natural.compute_logprobs(trajs) != runs[True][0]  # the forced routing did apply
    natural.close()


def test_unpacked_forwards_of_an_installed_model_are_plain_sdpa(tmp_path) -> None:
    """Padded rows (and an engine sharing the model) see SDPA under its own masks; a saved checkpoint
    names no custom attention."""
    model, _ = build_tiny("tiny-qwen3", seed=0)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        assert varlen.install(model)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    model.save_pretrained(tmp_path)
    assert varlen.NAME not in (tmp_path / "config.json").read_text()


def test_packing_refuses_true_on_policy_and_falls_back_where_varlen_does_not_apply() -> None:
    with pytest.raises(UserError, match="true_on_policy"):
        make_trainer(pack_sequences=True, true_on_policy=True)
    model, _ = build_tiny("tiny-qwen3", seed=0)
    model.config._attn_implementation = "eager"
    assert not varlen.install(model)  # transformers' block-diagonal mask keeps packing exact there
    assert varlen.forward_kwargs(model, [3, 2], torch.device("cpu")) == {}
    trajs = ragged_trajectories()
    mb = pack(build_micro_batch(trajs, [0, 1], None, pad_id=0))
    with torch.no_grad():
        packed = model(input_ids=mb.packed_ids, position_ids=mb.packed_positions, use_cache=False).logits[0]
        for b, i in enumerate(mb.indices):
            n, start = len(trajs[i].tokens), sum(mb.packed_lengths[:b])
            alone = model(input_ids=torch.tensor([trajs[i].tokens])).logits[0]
            assert torch.allclose(packed[start:start + n], alone, atol=1e-5)


def test_lora_adapters_train_the_same_packed() -> None:
    pytest.importorskip("peft")
    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.trainers.lora_options import LoraSection

    trajs, runs = ragged_trajectories(), []
    for pack_sequences in (False, True):
        model, tok = build_tiny("tiny-qwen3", seed=0)
        torch.manual_seed(0)  # the adapters' random init
        trainer = FSDP2Trainer(model, tok, TrainConfig(lr=1e-3, micro_batch_tokens=48, pack_sequences=pack_sequences),
                               AlgoConfig(), lora=LoraSection(rank=4))
        assert varlen.installed(trainer.model) == pack_sequences
        runs.append(logprobs_and_grads(trainer, trajs))
        trainer.close()
    assert runs[0][1] and all(".lora_" in k for k in runs[0][1])
    assert_same(runs[1], runs[0])
