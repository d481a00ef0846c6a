"""Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air): HF -> Megatron -> HF is bit-exact on checkpoint names, and
Megatron-core computes HF's logits (tiny random-init models from a transformers config)."""

from __future__ import annotations

import pytest
import torch
from tiny_moe_models import VOCAB, glm_config, tiny_checkpoint

from miles_agent.trainers.megatron.bridge import arch_spec, hf_to_megatron, megatron_to_hf
from miles_agent.trainers.megatron.model import ParallelSizes, build_gpt, padded_vocab
from miles_agent.trainers.megatron.sharding import RankCoords, merge, shard


@pytest.mark.parametrize("qk_norm", [True, False])
def test_round_trip_is_bit_exact(qk_norm, tmp_path):
    model, hf = tiny_checkpoint(glm_config(use_qk_norm=qk_norm), tmp_path)
    spec = arch_spec(model.config)
    assert (spec.rotary_percent, spec.qkv_bias, spec.qk_norm, spec.moe_layers) == (0.5, True, qk_norm, (1, 2))
    assert ("model.layers.0.self_attn.q_norm.weight" in hf) == qk_norm
    back = megatron_to_hf(hf_to_megatron(hf, spec, vocab_size=padded_vocab(spec, 2)), spec)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def _logits(gpt, model, mc, seq=16):
    gpt.load_state_dict(mc, strict=False)
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return gpt(ids, torch.arange(seq).expand(2, -1), causal)[..., :VOCAB], model(input_ids=ids).logits


@pytest.mark.parametrize("qk_norm", [True, False])
def test_megatron_model_computes_hf_logits(qk_norm, tmp_path, megatron_single_rank):
    model, hf = tiny_checkpoint(glm_config(use_qk_norm=qk_norm), tmp_path)
    spec = arch_spec(model.config)
    gpt = build_gpt(spec, ParallelSizes())
    mc = hf_to_megatron(hf, spec, vocab_size=padded_vocab(spec, 1))
    own = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    assert own == set(mc), sorted(own ^ set(mc))
    got, want = _logits(gpt, model, mc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # The checks bite: the fused bias's group order and the partial rotary both change the logits.
    bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    got, _ = _logits(gpt, model, dict(mc, **{bias: mc[bias].flip(0)}))
    assert not torch.allclose(got, want, atol=1e-3)
    gpt_full_rope = build_gpt(spec.__class__(**{**spec.__dict__, "rotary_percent": 1.0}), ParallelSizes())
    got, _ = _logits(gpt_full_rope, model, mc)
    assert not torch.allclose(got, want, atol=1e-3)

    gpt.load_state_dict(mc, strict=False)
    back = megatron_to_hf({k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, spec)
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k


def test_shard_then_merge_is_identity(tmp_path):
    model, hf = tiny_checkpoint(glm_config(), tmp_path)
    spec = arch_spec(model.config)
    sizes = ParallelSizes(tensor=2, pipeline=3, expert=4)
    full = hf_to_megatron(hf, spec, padded_vocab(spec, 2))
    states = {RankCoords(t, p, e): shard(full, spec, sizes, RankCoords(t, p, e))
              for t in range(2) for p in range(3) for e in range(4)}
    # tensor rank 1 holds the second KV group: its 2 query heads, K and V, weights and biases alike
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
    torch.testing.assert_close(states[RankCoords(1)]["decoder.layers.0.self_attention.linear_qkv.bias"],
                               torch.cat([q[32:], k[16:], v[16:]]), rtol=0, atol=0)
    merged = merge(states, spec, sizes)
    assert set(merged) == set(full)
    for k in full:
        assert torch.equal(merged[k], full[k]), k


def test_real_megatron_ranks_tensor_and_expert_parallel(tmp_path):
    from test_sharding import _run_ranks

    model, hf = tiny_checkpoint(glm_config(), tmp_path / "hf")
    spec = arch_spec(model.config)
    results = _run_ranks(2, tmp_path / "hf", "2,1,2", tmp_path)
    merged = merge({r["coords"]: r["state"] for r in results}, spec, ParallelSizes(2, 1, 2))
    back = megatron_to_hf(merged, spec)
    assert set(back) == set(hf)
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k
    for r in results:
        torch.testing.assert_close(r["logits"], r["hf_logits"], rtol=1e-5, atol=1e-5)
