"""Sampling parameters, stop conditions and request validation of the embedded engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import GREEDY, prompts, run_all

from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.engines.embedded.sampling import sample


def one(engine, prompt, sampling=GREEDY, **kw):
    return run_all(engine, [prompt], sampling, **kw)[0]


def test_stop_token_is_kept_and_finishes_stop(make_engine):
    engine = make_engine()
    p = prompts(20, seed=10)[0]
    ref = one(engine, p).output_ids
    stop = ref[5]
    first = ref.index(stop)
    out = one(engine, p, SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=(stop,)))
    assert out.output_ids == ref[: first + 1]
    assert out.output_ids[-1] == stop
    assert len(out.output_logprobs) == len(out.output_ids)
    assert out.finish_reason is FinishReason.STOP
    assert out.meta["matched_stop"] == stop


def test_eos_stops_like_sglang(make_engine):
    """The model's EOS stops generation (kept, finish stop) even when stop_token_ids is empty."""
    engine = make_engine()
    p = prompts(20, seed=10)[0]
    ref = one(engine, p).output_ids
    engine.eos_ids = frozenset({ref[3]})
    out = one(engine, p)
    assert out.output_ids == ref[: ref.index(ref[3]) + 1]
    assert out.finish_reason is FinishReason.STOP


def test_max_new_tokens_finishes_length(make_engine):
    engine = make_engine()
    out = one(engine, prompts(10)[0], SamplingParams(max_new_tokens=7, temperature=0))
    assert len(out.output_ids) == 7
    assert out.finish_reason is FinishReason.LENGTH
    zero = one(engine, prompts(10)[0], SamplingParams(max_new_tokens=0))
    assert zero.output_ids == [] and zero.finish_reason is FinishReason.LENGTH


def test_context_limit_finishes_length(make_engine):
    engine = make_engine(max_seq_len=40)
    out = one(engine, prompts(30)[0], SamplingParams(max_new_tokens=50, temperature=0))
    assert len(out.output_ids) == 10
    assert out.finish_reason is FinishReason.LENGTH


def test_stop_string_ends_output_after_it(make_engine, tiny_models):
    tok = tiny_models["tiny-qwen3"][1]
    engine = make_engine()
    p = prompts(15, seed=11)[0]
    ref = one(engine, p, SamplingParams(max_new_tokens=24, temperature=0)).output_ids
    stop = tok.decode(ref[6:8])
    expected = next(ref[:n] for n in range(1, len(ref) + 1) if stop in tok.decode(ref[:n]))
    out = one(engine, p, SamplingParams(max_new_tokens=24, temperature=0, stop=(stop,)))
    assert out.output_ids == expected
    assert tok.decode(out.output_ids).endswith(stop)
    assert out.finish_reason is FinishReason.STOP
    assert out.meta["matched_stop"] == stop


def test_seeded_sampling_is_reproducible(make_engine):
    engine = make_engine()
    p = prompts(12, seed=12)[0]
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=99)
    a, b = one(engine, p, sp), one(make_engine(), p, sp)
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    c = one(engine, p, SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=100))
    assert c.output_ids != a.output_ids


def test_top_k_one_equals_greedy(make_engine):
    engine = make_engine()
    ps = prompts(8, 21, seed=13)
    greedy = run_all(engine, ps, GREEDY)
    topk1 = run_all(engine, ps, SamplingParams(max_new_tokens=16, temperature=0.8, top_k=1))
    assert [g.output_ids for g in greedy] == [t.output_ids for t in topk1]


@pytest.fixture(params=["torch", "cpu-kernels"])
def kernels(request):
    """The sampler in torch, and in the engine's compiled CPU kernels (skipped where they cannot be built)."""
    if request.param == "torch":
        return None
    from miles_agent.engines.embedded import cpu_kernels

    if cpu_kernels.toolchain_missing():
        pytest.skip(cpu_kernels.toolchain_missing())
    return cpu_kernels.load()


def test_sampler_top_p_and_top_k_keep_only_the_nucleus(kernels):
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log()
    seen_p, seen_k = set(), set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seen_p.update(sample(logits, [SamplingParams(top_p=0.5)], [gen], kernels=kernels)[0])
        seen_k.update(sample(logits, [SamplingParams(top_k=3)], [gen], kernels=kernels)[0])
    assert seen_p == {0, 1}
    assert seen_k == {0, 1, 2}
    toks, lps = sample(logits, [SamplingParams(temperature=0)], [gen], kernels=kernels)
    assert toks == [0] and lps[0] == pytest.approx(float(logits.log_softmax(-1)[0, 0]))


def test_bad_requests_raise_value_error(make_engine, tiny_models):
    engine = make_engine(max_seq_len=32)
    too_long = prompts(32)[0]

    async def main():
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([], GREEDY)
        with pytest.raises(ValueError, match="context"):
            await engine.generate(too_long, GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.generate([1, 10**6], GREEDY)
        with pytest.raises(ValueError, match="MoE"):
            await engine.generate([1, 2], GREEDY, return_routed_experts=True)
        assert await engine.health()

    asyncio.run(main())
    from miles_agent.engines.embedded.engine import EmbeddedEngine

    no_tok = EmbeddedEngine(tiny_models["tiny-qwen3"][0].__class__(tiny_models["tiny-qwen3"][0].config))
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(no_tok.generate([1, 2], SamplingParams(stop=("x",))))


def test_unsupported_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles_agent.engines.embedded.engine import EmbeddedEngine

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=50)
    with pytest.raises(ValueError, match="qwen3"):
        EmbeddedEngine(LlamaForCausalLM(cfg))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=3)],
                         ids=["plain", "top-p", "top-k"])
def test_sampler_draws_from_the_distribution(kernels, params):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    gen = torch.Generator().manual_seed(1)
    toks, _ = sample(probs.log().expand(n, 4).contiguous(), [params] * n, [gen] * n, kernels=kernels)
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    want = probs if params.top_k < 0 and params.top_p >= 1 else torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95
    assert torch.allclose(freq, want, atol=0.03), freq


def test_a_seeded_row_draws_the_same_token_beside_any_other_row(kernels):
    """Whether a batch-mate filters (top-p / top-k) or not must not change how a row maps its uniform to a
    token: the sampler walks an unfiltered row in token order and a filtered one by probability, per row."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 50, generator=g)
    plain, nucleus = SamplingParams(seed=1), SamplingParams(seed=2, top_p=0.8)

    def draw(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = [sample(logits[i:i + 1], [p], [draw(i)], kernels=kernels)[0][0] for i, p in enumerate((plain, nucleus))]
    together = sample(logits, [plain, nucleus], [draw(0), draw(1)], kernels=kernels)[0]
    assert together == alone
