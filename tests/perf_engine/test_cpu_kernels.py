"""The embedded engine's compiled CPU kernels (engines/embedded/cpu_kernels.cpp) against its torch forward.

The kernels run a Qwen3 layer's attention block and dense MLP block over token rows (no padding) and the
runner's slot KV cache, for prefill and decode alike. What must hold:

- the same logits as the torch forward, for head sizes and query groups that take the vectorized paths
  (head_dim 32 / 48 / 64 / 128, group 1 / 2 / 3 / 4 / 8), a head size whose last dims take plain loops
  (40), a group larger than a tile (16), and a cache whose length is no multiple of the kernels' blocks;
  scattered slots, uneven spans, a prefill that continues a cached prefix;
- a MoE model's routed experts (R3 rows) are the torch forward's, prompt tokens included;
- an engine on kernels samples what an engine on torch samples (greedy tokens, logprobs to rounding);
- bad input to a kernel is refused with the cause; ``MILES_AGENT_CPU_KERNELS=0`` turns them off; asking
  for them where they cannot run (true on-policy mode) says why.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded import cpu_kernels
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.embedded.model_runner import ModelRunner
from miles_agent.models.builder import build_tiny

TOL = 2e-5  # float rounding (other summation orders); a wrong head, position or slot is O(0.1)


@pytest.fixture(autouse=True)
def _needs_kernels(kernels_built) -> None:  # noqa: ANN001 - conftest's skip-or-build check, for every test here
    pass


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def qwen3(heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=265, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def runners(model: torch.nn.Module, slots: int = 8, max_len: int = 512) -> tuple[ModelRunner, ModelRunner]:
    cpu = torch.device("cpu")
    fast = ModelRunner(copy.deepcopy(model), cpu, max_len, slots, cpu_kernels=True)
    reference = ModelRunner(copy.deepcopy(model), cpu, max_len, slots, cpu_kernels=False)
    assert fast.kernels is not None and reference.kernels is None
    return fast, reference


def steps(runner: ModelRunner, slots: list[int], seqs: list[list[int]], record: bool = False) -> list:
    """Prefill a first part of each sequence, continue it from the cache, then three greedy decode steps."""
    half = [s[: len(s) // 3 + 1] for s in seqs]
    out = [runner.prefill(slots, half, record)]
    rest = [s[len(h):] for s, h in zip(seqs, half)]
    out.append(runner.prefill(slots, rest, record, starts=[len(h) for h in half]))
    positions = [len(s) for s in seqs]
    logits = out[-1][0]
    for _ in range(3):
        out.append(runner.decode(slots, logits.argmax(-1).tolist(), positions, record))
        logits = out[-1][0]
        positions = [p + 1 for p in positions]
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (4, 4, 32), (4, 2, 32), (8, 2, 64), (8, 1, 128), (8, 1, 32),  # group 1 / 2 / 4 / 8
    (6, 2, 48),  # group 3; head_dim 48: value chunks of 32 and 16 dims
    (6, 2, 40),  # head_dim 40: its last 8 dims in plain loops
    (16, 1, 32),  # group 16: a token's heads split over two tiles
])
def test_kernels_match_the_torch_forward(heads, kv_heads, head_dim):
    fast, reference = runners(qwen3(heads, kv_heads, head_dim))
    slots, seqs = [6, 0, 3], prompts(3, 30, seed=heads + head_dim)  # scattered slots, spans 30 / 37 / 44
    with torch.inference_mode():
        for (a, _), (b, _) in zip(steps(fast, slots, seqs), steps(reference, slots, seqs)):
            assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max()


def test_a_cache_length_that_is_no_multiple_of_the_kernels_blocks():
    """A cache 50 positions long: the key blocks of 64 and then 16 positions stop short of its end, and the
    last positions take the one-by-one loop (a block may not read past a cache row)."""
    fast, reference = runners(qwen3(4, 2, 32), max_len=50)
    slots, seqs = [1, 0], prompts(2, 40, seed=5)  # 40 / 47 tokens + 3 decode steps: positions up to 49
    with torch.inference_mode():
        for (a, _), (b, _) in zip(steps(fast, slots, seqs), steps(reference, slots, seqs)):
            assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max()
    assert fast.k_cache.shape[-1] == 50


def test_moe_routing_rows_are_the_torch_forwards():
    model, _ = build_tiny("tiny-qwen3-moe")
    fast, reference = runners(model)
    seqs = prompts(3, 20, seed=7)
    with torch.inference_mode():
        got, want = steps(fast, [1, 2, 5], seqs, record=True), steps(reference, [1, 2, 5], seqs, record=True)
    for call, ((a, rows_a), (b, rows_b)) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, atol=TOL, rtol=0)
        if call < 2:  # prefill: [B, T_max, layers, top_k], rows past a span are padding
            span = [len(s) // 3 + 1 for s in seqs] if call == 0 else [len(s) - len(s) // 3 - 1 for s in seqs]
            for b_, n in enumerate(span):
                assert (rows_a[b_, :n] == rows_b[b_, :n]).all()
        else:
            assert (rows_a == rows_b).all()


def test_an_engine_on_kernels_samples_what_the_torch_engine_samples():
    model, tok = build_tiny("tiny-qwen3")
    sampling = SamplingParams(max_new_tokens=12, temperature=0)

    async def run(kernels: bool) -> list:
        engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4, cpu_kernels=kernels)
        first = await asyncio.gather(*[engine.generate(p, sampling) for p in prompts(4, 15, seed=8)])
        # a second turn over the first one's cached prefix
        second = await asyncio.gather(*[engine.generate(p + c.output_ids + [5, 6], sampling)
                                        for p, c in zip(prompts(4, 15, seed=8), first)])
        assert engine.stats["cached_tokens"] > 0
        return first + second

    got, want = asyncio.run(run(True)), asyncio.run(run(False))
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4


def test_a_token_outside_the_cache_is_refused():
    fast, _ = runners(qwen3(4, 2, 32))
    fast.ensure_capacity(2, 16)
    layer = fast.layers[0]
    attn, qkv, o = layer.self_attn, fast.fused.qkv[0], fast.fused.o[0]
    h, rope = torch.zeros(1, 96), torch.zeros(1, 2, 32)
    capacity = fast.k_cache.shape[-1]
    args = dict(slots=torch.tensor([0]), positions=torch.tensor([capacity]))  # one past the cache's end
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        fast.kernels.attention_block(h, layer.input_layernorm.weight, 1e-6, qkv.weight.t(), None,
                                     attn.q_norm.weight, attn.k_norm.weight, 1e-6, rope, fast.k_cache[0],
                                     fast.v_cache[0], args["slots"], args["positions"], o.weight.t(), None, 0.17, 4, 2)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        fast.kernels.mlp_block(h.double(), layer.post_attention_layernorm.weight, 1e-6,
                               fast.fused.gate_up[0].weight.t(), fast.fused.down[0].weight.t())
    with pytest.raises(RuntimeError, match="the weight transposed"):  # the module's [out, in] weight, not [in, out]
        fast.kernels.mlp_block(h, layer.post_attention_layernorm.weight, 1e-6, fast.fused.gate_up[0].weight,
                               fast.fused.down[0].weight)


def test_the_switch_and_the_reasons(monkeypatch):
    model, tok = build_tiny("tiny-qwen3")
    monkeypatch.setenv("MILES_AGENT_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None and cpu_kernels.unavailable_reason() == "MILES_AGENT_CPU_KERNELS=0"
    assert EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=2).runner.kernels is None
    monkeypatch.delenv("MILES_AGENT_CPU_KERNELS")
    assert EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=2).runner.kernels is not None  # the default
    with pytest.raises(ValueError, match="on-policy"):
        EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=2, true_on_policy=True, cpu_kernels=True)
    exact = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=2, true_on_policy=True)
    assert exact.runner.kernels is None and "on-policy" in exact.runner.kernels_reason


def test_the_kernel_sampler_draws_what_the_torch_sampler_draws():
    """Same uniforms in, same tokens out (greedy, full vocabulary, top-p, top-k, both, other temperatures);
    logprobs equal to float rounding. Greedy rows take no draw on either side."""
    from miles_agent.engines.embedded.sampling import Uniforms, sample

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(64, 265, generator=g) * 3
    kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.0, top_k=20), dict(temperature=1.3, top_p=0.5, top_k=5), dict(temperature=1.0, top_p=0.95),
             # flat distributions: the nucleus runs past the first sorted chunks (64, then 128 ranks)
             dict(temperature=8.0, top_p=0.99), dict(temperature=4.0, top_k=200, top_p=0.999)]
    params = [SamplingParams(max_new_tokens=1, **kinds[i % len(kinds)]) for i in range(64)]

    def draws() -> list:
        return [Uniforms(torch.Generator().manual_seed(100 + i)) for i in range(64)]

    kernels = cpu_kernels.load()
    for _ in range(3):  # three steps: the same per-request streams on both sides
        want_draws, got_draws = draws(), draws()
        want = sample(logits, params, want_draws)
        got = sample(logits, params, got_draws, kernels=kernels)
        assert got[0] == want[0]
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-5
        assert [d.next() for d in got_draws] == [d.next() for d in want_draws]  # as many draws taken
        logits = logits.roll(1, dims=1)
    top = sample(logits[:1], [SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1)], draws()[:1],
                 kernels=kernels)[0]
    assert top == [int(logits[0].argmax())]  # top_k=1 is greedy whatever the draw


def test_transposed_weight_copies_follow_every_write():
    """The kernels multiply small models' weights from transposed copies; a copy must never outlive the weights:
    an in-place write through torch (its version counter), and a write torch does not count (``.data``, as a
    collective's receive into a parameter may be) followed by the weight load every sync ends with."""
    model, _ = build_tiny("tiny-qwen3")
    fast, reference = runners(model)
    assert fast.fused.transposed_copies
    seqs, slots = prompts(2, 16, seed=11), [0, 1]

    def perturbed(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()
                if "proj" in n}

    def compare() -> torch.Tensor:
        with torch.inference_mode():
            got, want = steps(fast, slots, seqs)[-1][0], steps(reference, slots, seqs)[-1][0]
        assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
        return got

    before = compare()  # the copies exist now
    new = perturbed(1)
    with torch.no_grad():
        for runner in (fast, reference):
            for name, p in runner.model.named_parameters():
                if name in new:
                    p.copy_(new[name])
    after = compare()
    assert (after - before).abs().max() > 1e-2
    newer = perturbed(2)
    for runner in (fast, reference):
        for name, p in runner.model.named_parameters():
            if name in newer:
                p.data.copy_(newer[name])  # no version bump
        runner.load_weights([])
    assert (compare() - after).abs().max() > 1e-2


def test_the_moe_experts_kernel_computes_hfs_experts_bit_for_bit():
    """Same routing in, the same bits out as HF's experts module (whichever implementation its config picks):
    several tokens per expert, and tokens whose two slots name the same expert. An index that names no expert
    is refused."""
    from miles_agent.engines.embedded.model_runner import _experts_kernel_fits

    model, _ = build_tiny("tiny-qwen3-moe")
    experts = model.model.layers[1].mlp.experts
    assert _experts_kernel_fits(experts)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, experts.gate_up_proj.shape[2], generator=g)
    index = torch.randint(0, experts.num_experts, (37, 2), generator=g)
    assert (index[:, 0] == index[:, 1]).any()  # a token routed twice to one expert
    weights = torch.rand(37, 2, generator=g)
    kernels = cpu_kernels.load()
    with torch.inference_mode():
        want = experts(x, index, weights)
        got = kernels.moe_experts(x, index, weights, experts.gate_up_proj, experts.down_proj)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="expert index 8 is outside 0..7"):
        kernels.moe_experts(x, index.clamp(min=experts.num_experts), weights, experts.gate_up_proj, experts.down_proj)


def test_moe_experts_that_are_wrapped_take_the_module():
    """A layer whose experts are not HF's as built (a wrapper, another dtype) runs through its own module."""
    from miles_agent.engines.embedded.model_runner import _experts_kernel_fits

    model, _ = build_tiny("tiny-qwen3-moe")
    experts = model.model.layers[0].mlp.experts
    wrapper = torch.nn.Module()
    wrapper.gate_up_proj, wrapper.down_proj, wrapper.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn
    assert not _experts_kernel_fits(wrapper)
    assert not _experts_kernel_fits(copy.deepcopy(experts).double())
