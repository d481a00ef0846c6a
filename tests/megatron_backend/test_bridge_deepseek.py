"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2): HF -> Megatron -> HF is bit-exact on checkpoint names, and
Megatron-core's MLA model computes HF's logits (tiny random-init models from a transformers config)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_moe_models import VOCAB, deepseek_config, tiny_checkpoint

from miles_agent.errors import UserError
from miles_agent.trainers.megatron.bridge import arch_spec, hf_to_megatron, megatron_to_hf
from miles_agent.trainers.megatron.model import ParallelSizes, build_gpt, padded_vocab
from miles_agent.trainers.megatron.sharding import RankCoords, merge, shard

VARIANTS = {
    "q_lora": dict(),
    "no_q_lora": dict(q_lora_rank=None),  # queries projected directly (linear_q_proj)
    "yarn": dict(yarn=True),
    "halves_rope": dict(rope_interleave=False),  # rope rows permuted on the way in and out
}


def _round_trip_exact(hf, spec, vocab):
    back = megatron_to_hf(hf_to_megatron(hf, spec, vocab_size=vocab), spec)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(variant, tmp_path):
    model, hf = tiny_checkpoint(deepseek_config(**VARIANTS[variant]), tmp_path)
    spec = arch_spec(model.config)
    assert spec.moe_layers == (1, 2) and spec.shared_expert_ffn_hidden_size == 32
    assert {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.7.up_proj.weight",
            "model.layers.2.mlp.shared_experts.down_proj.weight"} <= set(hf)
    _round_trip_exact(hf, spec, padded_vocab(spec, 2))


def _logits(gpt, model, mc, seq=24):
    gpt.load_state_dict(mc, strict=False)
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return gpt(ids, torch.arange(seq).expand(2, -1), causal)[..., :VOCAB], model(input_ids=ids).logits


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora", "yarn"])
def test_megatron_mla_model_computes_hf_logits(variant, tmp_path, megatron_single_rank):
    model, hf = tiny_checkpoint(deepseek_config(**VARIANTS[variant]), tmp_path)
    spec = arch_spec(model.config)
    gpt = build_gpt(spec, ParallelSizes())
    mc = hf_to_megatron(hf, spec, vocab_size=padded_vocab(spec, 1))
    own = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    assert own == set(mc), sorted(own ^ set(mc))
    got, want = _logits(gpt, model, mc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # The checks bite: the expert bias steers routing, and the rope rows' order matters.
    bias = "decoder.layers.2.mlp.router.expert_bias"
    got, _ = _logits(gpt, model, dict(mc, **{bias: torch.zeros_like(mc[bias])}))
    assert not torch.allclose(got, want, atol=1e-3)
    kv = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    swapped = mc[kv].clone()
    swapped[-8:] = torch.cat([mc[kv][-8::2], mc[kv][-7::2]])  # HF's interleaved rows read as halves
    got, _ = _logits(gpt, model, dict(mc, **{kv: swapped}))
    assert not torch.allclose(got, want, atol=1e-3)

    # Megatron's own tensors convert back to the HF checkpoint bit for bit.
    gpt.load_state_dict(mc, strict=False)
    back = megatron_to_hf({k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, spec)
    assert set(back) == set(hf)
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k


def test_mtp_layers_are_skipped_with_a_warning_and_strays_refused(tmp_path, caplog):
    model, hf = tiny_checkpoint(deepseek_config(), tmp_path)
    spec = arch_spec(model.config)
    assert spec.mtp_layers == 1  # DeepSeek-V3's num_nextn_predict_layers; transformers builds no MTP layer
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.3.enorm.weight": torch.ones(64),
           "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(128, 16)}
    with caplog.at_level(logging.WARNING):
        mc = hf_to_megatron({**hf, **mtp}, spec)
    assert "skipping 3 multi-token-prediction tensors" in caplog.text
    assert not any(".layers.3." in k for k in mc)
    with pytest.raises(UserError, match="model.layers.4.enorm.weight"):  # past the MTP layers: refused
        hf_to_megatron({**hf, "model.layers.4.enorm.weight": torch.ones(64)}, spec)
    del hf["model.layers.2.mlp.gate.e_score_correction_bias"]
    with pytest.raises(UserError, match="missing 1 tensors.*layers.2.mlp.gate.e_score_correction_bias"):
        hf_to_megatron(hf, spec)


def test_routing_megatron_computes_differently_is_refused(tmp_path):
    cfg = deepseek_config()
    cfg.topk_group = 1  # top-4 from 1 of 4 groups: HF ranks groups by top-2, Megatron by top-4
    with pytest.raises(UserError, match="topk_group"):
        arch_spec(cfg)
    cfg = deepseek_config()
    cfg.norm_topk_prob = False
    with pytest.raises(UserError, match="norm_topk_prob"):
        arch_spec(cfg)


def test_tensor_parallel_sizes_check_the_latent_dims(tmp_path):
    spec = arch_spec(deepseek_config())
    ParallelSizes(tensor=4, expert=2).check(spec, world_size=4)
    with pytest.raises(UserError, match=r"kv_lora_rank \+ qk_rope_head_dim\) \(24\)"):
        ParallelSizes(tensor=16).check(spec)


def test_shard_then_merge_is_identity(tmp_path):
    model, hf = tiny_checkpoint(deepseek_config(), tmp_path)
    spec = arch_spec(model.config)
    sizes = ParallelSizes(tensor=2, pipeline=3, expert=2, expert_tensor=2)
    full = hf_to_megatron(hf, spec, padded_vocab(spec, 2))
    states = {RankCoords(t, p, e, et): shard(full, spec, sizes, RankCoords(t, p, e, et))
              for t in range(2) for p in range(3) for e in range(2) for et in range(2)}
    kv_down = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert states[RankCoords(1)][kv_down].shape == (12, 64)  # (16 + 8 latent/rope rows) / 2
    merged = merge(states, spec, sizes)
    assert set(merged) == set(full)
    for k in full:
        assert torch.equal(merged[k], full[k]), k


@pytest.mark.parametrize("world,sizes", [
    (2, "2,1,2"),
    # tensor 2 x pipeline 2 (dense layer 0 and MoE layer 1 on stage 0), experts over 2 ranks: nightly
    pytest.param(4, "2,2,2", marks=pytest.mark.slow),
])
def test_real_megatron_ranks_hold_the_planned_shards(world, sizes, tmp_path):
    """Gloo ranks each build their GPTModel, load their planned shard strictly (same names and shapes), and
    without pipeline stages the tensor x expert-parallel forward gives HF's logits."""
    from test_sharding import _run_ranks

    model, hf = tiny_checkpoint(deepseek_config(layers=4), tmp_path / "hf")
    spec = arch_spec(model.config)
    results = _run_ranks(world, tmp_path / "hf", sizes, tmp_path)
    tp, pp, ep = map(int, sizes.split(","))
    merged = merge({r["coords"]: r["state"] for r in results}, spec, ParallelSizes(tp, pp, ep))
    back = megatron_to_hf(merged, spec)
    assert set(back) == set(hf)
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k
    for r in results:
        if "logits" in r:
            torch.testing.assert_close(r["logits"], r["hf_logits"], rtol=1e-5, atol=1e-5)
    assert any("logits" in r for r in results) == (pp == 1)
