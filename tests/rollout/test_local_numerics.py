"""The embedded engine computes what HF computes: logprobs, greedy tokens, routed experts, batching-invariance."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import GREEDY, hf_greedy, prompts, run_all

from miles_agent.engine import FinishReason, SamplingParams

ARCHS = ["tiny-qwen3", "tiny-qwen3-moe"]


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of every output token, from one full HF forward over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = (logits[len(prompt) - 1 : -1] / temperature).log_softmax(-1)
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_hf_forward_concurrent(arch, tiny_models, make_engine):
    torch.manual_seed(0)
    model = tiny_models[arch][0]
    engine = make_engine(arch)
    ps = prompts(3, 21, 40, 9, 64)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=None)
    outs = run_all(engine, ps, sampling)
    assert engine.mean_decode_batch > 1
    for p, out in zip(ps, outs):
        assert len(out.output_ids) == len(out.output_logprobs) > 0
        assert out.prompt_tokens == len(p)
        ref = hf_logprobs(model, p, out.output_ids)
        assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-4), (arch, len(p))


def test_logprob_convention_divides_by_temperature(tiny_models, make_engine):
    """output_logprobs = log_softmax(logits / T)[token], before top-p/top-k filtering."""
    model = tiny_models["tiny-qwen3"][0]
    engine = make_engine()
    ps = prompts(12, 30, seed=1)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.6, top_p=0.9, top_k=20, seed=3)
    for p, out in zip(ps, run_all(engine, ps, sampling)):
        ref = hf_logprobs(model, p, out.output_ids, temperature=0.6)
        assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(arch, tiny_models, make_engine):
    model = tiny_models[arch][0]
    engine = make_engine(arch)
    ps = prompts(5, 17, 33, seed=2)
    outs = run_all(engine, ps, GREEDY)
    for p, out in zip(ps, outs):
        ref = hf_greedy(model, p, GREEDY.max_new_tokens)
        assert out.output_ids == ref
        assert out.finish_reason is (FinishReason.LENGTH if len(ref) == GREEDY.max_new_tokens else FinishReason.STOP)


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_requests_are_batched_and_equal_alone(arch, make_engine):
    ps = prompts(4, 9, 16, 25, 36, 49, 7, 12, seed=3)
    alone_engine = make_engine(arch)
    alone = [run_all(alone_engine, [p])[0] for p in ps]
    assert alone_engine.mean_decode_batch == 1
    engine = make_engine(arch)
    together = run_all(engine, ps)
    assert engine.mean_decode_batch > 4, engine.stats
    assert engine.stats["prefill_batches"] < len(ps)
    for a, t in zip(alone, together):
        assert a.output_ids == t.output_ids
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(t.output_logprobs), atol=1e-5)


def test_seeded_sampling_is_batching_invariant(make_engine):
    """A seeded request owns its generator: same tokens alone or in a batch with others."""
    ps = prompts(10, 20, 30, seed=4)
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1234)
    alone = run_all(make_engine(), ps[:1], sampling)[0]
    together = run_all(make_engine(), ps, sampling)[0]
    assert alone.output_ids == together.output_ids


def test_routed_experts_match_hf_router(tiny_models, make_engine):
    model = tiny_models["tiny-qwen3-moe"][0]
    cfg = model.config
    engine = make_engine("tiny-qwen3-moe")
    ps = prompts(6, 19, 31, seed=5)
    outs = run_all(engine, ps, SamplingParams(max_new_tokens=10, temperature=1.0, seed=7),
                   return_routed_experts=True)
    for p, out in zip(ps, outs):
        tokens = p + out.output_ids
        re = out.routed_experts
        assert re.dtype.name == "int32"
        assert re.shape == (len(tokens) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        with torch.no_grad():
            router_logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
        ref = torch.stack([rl.view(len(tokens), -1).softmax(-1).topk(cfg.num_experts_per_tok, -1).indices
                           for rl in router_logits], dim=1)[:-1]
        assert (torch.from_numpy(re).long() == ref).all()


def test_routed_experts_absent_unless_asked(make_engine):
    out = run_all(make_engine("tiny-qwen3-moe"), prompts(8))[0]
    assert out.routed_experts is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_logprobs_and_routing_match_hf(arch, tiny_models):
    import copy

    from miles_agent.engines.embedded.engine import EmbeddedEngine

    model, tok = tiny_models[arch]
    ref_model = copy.deepcopy(model).cuda()
    engine = EmbeddedEngine(copy.deepcopy(model), tok, device="cuda")
    ps = prompts(7, 30, 55, seed=6)
    moe = arch.endswith("moe")
    outs = run_all(engine, ps, SamplingParams(max_new_tokens=16, temperature=1.0, seed=1), return_routed_experts=moe)
    assert engine.mean_decode_batch > 1
    for p, out in zip(ps, outs):
        with torch.no_grad():
            logits = ref_model(torch.tensor([p + out.output_ids], device="cuda")).logits[0].float().cpu()
        ref = logits[len(p) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-3)
        if moe:
            assert out.routed_experts.shape[0] == len(p) + len(out.output_ids) - 1
