"""HF -> Megatron -> HF is bit-exact, and the converted Megatron model computes HF's logits."""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import tiny_hf_checkpoint

from miles_agent.errors import UserError
from miles_agent.trainers.megatron.bridge import arch_spec, hf_to_megatron, megatron_to_hf
from miles_agent.trainers.megatron.model import ParallelSizes, build_gpt, padded_vocab

ARCHS = ["tiny-qwen3", "tiny-qwen3-moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact(arch, tmp_path):
    model, hf = tiny_hf_checkpoint(arch, tmp_path)
    spec = arch_spec(model.config)
    mc = hf_to_megatron(hf, spec, vocab_size=padded_vocab(spec, 2))
    back = megatron_to_hf(mc, spec)
    expected = {k: v for k, v in hf.items() if not (spec.tied_embeddings and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_model_computes_hf_logits(arch, tmp_path, megatron_single_rank):
    model, hf = tiny_hf_checkpoint(arch, tmp_path)
    spec = arch_spec(model.config)
    gpt = build_gpt(spec, ParallelSizes())
    mc = hf_to_megatron(hf, spec, vocab_size=padded_vocab(spec, 1))
    missing, unexpected = gpt.load_state_dict(mc, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, -1)
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = gpt(ids, pos, causal)[..., : spec.vocab_size]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # A layout bug (e.g. Q and K groups swapped) must not pass: break the fused QKV and compare again.
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    broken = dict(mc, **{qkv: mc[qkv].flip(0)})
    gpt.load_state_dict(broken, strict=False)
    with torch.no_grad():
        assert not torch.allclose(gpt(ids, pos, causal)[..., : spec.vocab_size], want, atol=1e-3)

    # Megatron's own tensors convert back to the HF checkpoint bit for bit.
    gpt.load_state_dict(mc, strict=False)
    back = megatron_to_hf({k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, spec)
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    model, _ = tiny_hf_checkpoint("tiny-qwen3", tmp_path)
    model.config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(UserError, match="Qwen3ForCausalLM"):
        arch_spec(model.config)


def test_incomplete_checkpoint_names_the_missing_tensor(tmp_path):
    model, hf = tiny_hf_checkpoint("tiny-qwen3-moe", tmp_path)
    del hf["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(UserError, match="experts.5.up_proj"):
        hf_to_megatron(hf, arch_spec(model.config))


def test_parallel_sizes_that_do_not_divide_are_named(tmp_path):
    model, _ = tiny_hf_checkpoint("tiny-qwen3-moe", tmp_path)
    spec = arch_spec(model.config)
    ParallelSizes(tensor=2, pipeline=2, expert=4).check(spec, world_size=8)
    with pytest.raises(UserError, match="expert_parallel=3 does not divide the 8 experts"):
        ParallelSizes(expert=3).check(spec)
    with pytest.raises(UserError, match="pipeline_parallel=3"):
        ParallelSizes(pipeline=3).check(spec)
    assert ParallelSizes(pipeline=3, first_stage_layers=2).stage_sizes(4) == [2, 1, 1]
    assert ParallelSizes(pipeline=3, first_stage_layers=1, last_stage_layers=1).stage_sizes(4) == [1, 2, 1]
    with pytest.raises(UserError, match="first_stage_layers"):
        ParallelSizes(pipeline=3, first_stage_layers=1).check(spec)  # 3 layers left for 2 stages
