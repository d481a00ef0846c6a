"""Policy losses, KL estimators and aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles_agent.algorithms.losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    compute_loss,
    count_seqs,
    group_row_weights,
    gspo,
    k1,
    k2,
    k3,
    ppo_clip,
    validate_options,
)
from miles_agent.config import AlgoConfig
from miles_agent.errors import UserError

# ratios: row 0 = 1.5 (A=+1, clipped high), 0.5 (A=-1, clipped low), 1.0 (A=2);
#         row 1 = 0.5 (A=+1, not clipped), 1.5 (A=-1, not clipped), masked token
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 3.0]])
ADV = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.full((2, 3), -1.0)
LOGP = OLD + RATIOS.log()


def test_ppo_clip_per_token_and_clipfrac() -> None:
    per_tok, clipped = ppo_clip(LOGP, OLD, ADV, clip_eps=0.2)
    assert per_tok[0].tolist() == pytest.approx([-1.2, 0.8, -2.0])
    assert per_tok[1, :2].tolist() == pytest.approx([-0.5, 1.5])
    assert clipped[0].tolist() == [1.0, 1.0, 0.0]
    assert clipped[1, :2].tolist() == [0.0, 0.0]
    loss, m = compute_loss(LOGP, OLD, ADV, MASK, clip_eps=0.2)
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 2.0 - 0.5 + 1.5) / 5)
    assert float(m["clipfrac"]) == pytest.approx(2 / 5)
    assert float(m["pg_loss"]) == pytest.approx(float(loss))


def test_clipped_tokens_get_no_gradient() -> None:
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = compute_loss(logp, OLD, ADV, MASK, clip_eps=0.2)
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0 and g[0, 1] == 0 and g[1, 2] == 0  # two clipped, one masked
    assert g[0, 2] == pytest.approx(-2.0 / 5)  # d(-ratio*A)/dlogp = -ratio*A
    assert g[1, 0] == pytest.approx(-0.5 / 5) and g[1, 1] == pytest.approx(1.5 / 5)


def test_clip_higher() -> None:
    loss, m = compute_loss(LOGP, OLD, ADV, MASK, clip_eps=0.2, clip_eps_high=0.6)
    # ratio 1.5 with A=+1 is now inside [0.8, 1.6]: -1.5, no longer clipped
    assert float(loss) == pytest.approx((-1.5 + 0.8 - 2.0 - 0.5 + 1.5) / 5)
    assert float(m["clipfrac"]) == pytest.approx(1 / 5)


def test_aggregation_modes() -> None:
    per_tok, _ = ppo_clip(LOGP, OLD, ADV)
    assert float(aggregate(per_tok, MASK, "seq_mean_token_sum")) == pytest.approx((-2.4 + 1.0) / 2)
    assert float(aggregate(per_tok, MASK, "seq_mean_token_mean")) == pytest.approx((-0.8 + 0.5) / 2)
    mask = MASK.clone()
    mask[1] = 0  # a fully masked sequence does not count
    assert count_seqs(mask) == 1
    assert float(aggregate(per_tok, mask, "seq_mean_token_mean")) == pytest.approx(-0.8)
    with pytest.raises(UserError, match="token_mean"):
        aggregate(per_tok, MASK, "sum")


def test_kl_estimators_hand_values() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # logr = ref - logp = log(0.5)
    assert float(k1(logp, ref)) == pytest.approx(math.log(2))
    assert float(k2(logp, ref)) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(k3(logp, ref)) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(k3(ref, ref)) == 0.0
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_kl_and_entropy_terms() -> None:
    ref = OLD - 0.3
    entropy = torch.full((2, 3), 2.0)
    pg, _ = compute_loss(LOGP, OLD, ADV, MASK)
    loss, m = compute_loss(LOGP, OLD, ADV, MASK, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01,
                           ref_logp=ref, entropy=entropy)
    kl = float(aggregate(k2(LOGP, ref), MASK))
    assert float(m["kl"]) == pytest.approx(kl)
    assert float(m["entropy"]) == pytest.approx(2.0)
    assert float(loss) == pytest.approx(float(pg) + 0.1 * kl - 0.01 * 2.0)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_loss(LOGP, OLD, ADV, MASK, kl_coef=0.1)


def test_sft_is_masked_nll() -> None:
    loss, m = compute_loss(LOGP, OLD, ADV, MASK, loss="sft")
    assert float(loss) == pytest.approx(float(-(LOGP * MASK).sum() / 5))
    assert "clipfrac" not in m
    assert set(POLICY_LOSSES) >= {"ppo_clip", "sft"}
    with pytest.raises(UserError, match="ppo_clip"):
        compute_loss(LOGP, OLD, ADV, MASK, loss="ppo")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_micro_batches_sum_to_the_global_batch(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g) * 3
    old = logp + 0.3 * torch.randn(5, 7, generator=g)
    adv = torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    mask[2] = 0
    ref, ent = logp - 0.1, torch.rand(5, 7, generator=g)
    opts = dict(loss_agg=mode, kl_coef=0.05, entropy_coef=0.01)
    whole, mw = compute_loss(logp, old, adv, mask, ref_logp=ref, entropy=ent, **opts)
    norm = dict(num_tokens=float(mask.sum()), num_seqs=count_seqs(mask))
    parts = [compute_loss(logp[s], old[s], adv[s], mask[s], ref_logp=ref[s], entropy=ent[s], **opts, **norm)
             for s in (slice(0, 2), slice(2, 5))]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), abs=1e-6)
    for k in mw:
        assert float(sum(p[1][k] for p in parts)) == pytest.approx(float(mw[k]), abs=1e-6), k


def test_extreme_log_ratio_stays_finite() -> None:
    logp = torch.tensor([[-0.1, -0.1]], requires_grad=True)
    old = torch.tensor([[-200.0, -0.1]])  # a stale rollout logprob
    loss, _ = compute_loss(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# -- dual clip, GSPO, group-level aggregation, mismatch weights -------------------------------------

def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    ratio = torch.tensor([[3.0, 1.5, 3.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    logp = (OLD[:1] + ratio.log()).requires_grad_(True)
    per_tok, clipped = ppo_clip(logp, OLD[:1], adv, clip_eps=0.2, dual_clip_c=2.0)
    # ratio 3, A=-1: plain PPO gives 3, dual clip caps it at -c*A = 2; ratio 1.5 stays 1.5; A>0 untouched
    assert per_tok[0].tolist() == pytest.approx([2.0, 1.5, -1.2])
    assert clipped[0].tolist() == [1.0, 0.0, 1.0]
    per_tok.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1.5, 0.0])
    plain, _ = ppo_clip(logp, OLD[:1], adv, clip_eps=0.2)
    assert float(plain[0, 0].detach()) == pytest.approx(3.0)
    with pytest.raises(UserError, match="dual_clip_c"):
        validate_options(AlgoConfig(dual_clip_c=0.5))


def test_gspo_uses_the_geometric_mean_sequence_ratio() -> None:
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, -0.1, 5.0], [0.0, 0.6, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0] * 3, [1.0] * 3])
    per_tok, clipped = gspo(logp, old, adv, mask=mask, clip_eps=0.2)
    s0, s1 = math.exp(0.05), math.exp(0.3)  # the masked 5.0 does not count
    assert per_tok[0, :2].tolist() == pytest.approx([-s0, -s0])
    assert per_tok[1, :2].tolist() == pytest.approx([-1.2, -1.2])  # s1 = 1.35 clipped at 1.2
    assert clipped[:, :2].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    loss, m = compute_loss(logp, old, adv, mask, loss="gspo", clip_eps=0.2, loss_agg="seq_mean_token_mean")
    assert float(loss.detach()) == pytest.approx((-s0 - 1.2) / 2)
    assert float(m["clipfrac"]) == pytest.approx(0.5)
    loss.backward()
    # the sequence-level objective -(1/2) * s0 * A: d/dlogp_t = -(1/2) * s0 * (1/2)
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0])
    assert logp.grad[1].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert s1 > 1.2


def test_group_mean_token_mean_weighs_groups_equally() -> None:
    values = torch.tensor([[1.0, 3.0], [5.0, 0.0], [2.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    w = group_row_weights(["a", "a", "b"], [2, 1, 2])
    assert w == pytest.approx([1 / 6, 1 / 6, 1 / 4])
    # group a: (1 + 3 + 5) / 3 = 3; group b: (2 + 6) / 2 = 4; mean over groups 3.5
    got = aggregate(values, mask, "group_mean_token_mean", row_weights=torch.tensor(w))
    assert float(got) == pytest.approx(3.5)
    # split by rows (a micro-batch per row), the parts sum to the whole
    parts = [aggregate(values[i:i + 1], mask[i:i + 1], "group_mean_token_mean", row_weights=torch.tensor(w[i:i + 1]))
             for i in range(3)]
    assert float(sum(parts)) == pytest.approx(3.5)
    assert group_row_weights(["a", "b"], [0, 4]) == [0.0, 0.25]  # a group with no trainable token does not count


def test_is_weights_multiply_the_policy_loss_only() -> None:
    w = torch.tensor([[2.0, 0.0, 1.0], [0.5, 1.0, 1.0]])
    per_tok, _ = ppo_clip(LOGP, OLD, ADV)
    loss, m = compute_loss(LOGP, OLD, ADV, MASK, is_weights=w, ref_logp=OLD, kl_coef=0.1)
    pg = float((per_tok * w * MASK).sum() / 5)
    assert float(m["pg_loss"]) == pytest.approx(pg)
    assert float(loss) == pytest.approx(pg + 0.1 * float(m["kl"]))

