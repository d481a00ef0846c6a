"""The embedded engine's fast paths compute what the module path computes, and never on stale weights.

- The fused decoder (engines/embedded/fused.py) against the HF-module forward of the same runner: prefill
  and decode logits, dense and MoE, contiguous and scattered slots.
- Its weights are the model's: a by-name sync, a storage swap (``model.to`` off the device and back) and a
  projection wrapped after the engine was built all show up in the next forward.
- The same through the compiled CPU kernels (cpu_kernels.cpp), which are on by default on a CPU in fp32.
- Attention over the transposed key cache as two batched matmuls against SDPA's kernel.
- The sampler's per-request uniforms: a block is the same numbers as one draw per step.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_agent.engine import SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.embedded.sampling import Uniforms
from miles_agent.models.builder import build_tiny

ARCHS = ["tiny-qwen3", "tiny-qwen3-moe"]
TOL = 2e-5  # float rounding of other matmul kernels; a real bug (wrong head, stale weight) is O(0.1)


@pytest.fixture(scope="module")
def models():
    return {arch: build_tiny(arch) for arch in ARCHS}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def run_steps(runner, slots: list[int], seqs: list[list[int]], steps: int = 3) -> list[torch.Tensor]:
    """Prefill ``seqs`` into ``slots`` (half of each as a cached prefix, then the rest), then greedy decode."""
    half = [s[: len(s) // 2] for s in seqs]
    runner.prefill(slots, half, False)
    logits, _ = runner.prefill(slots, [s[len(h):] for s, h in zip(seqs, half)], False, starts=[len(h) for h in half])
    out = [logits]
    positions = [len(s) for s in seqs]
    for _ in range(steps):
        tokens = logits.argmax(-1).tolist()
        logits, _ = runner.decode(slots, tokens, positions, False)
        positions = [p + 1 for p in positions]
        out.append(logits)
    return out


def both_paths(runner, slots, seqs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    fused = runner.fused
    assert fused is not None, runner.unfused_reason
    fast = run_steps(runner, slots, seqs)
    runner.fused = None
    try:
        reference = run_steps(runner, slots, seqs)
    finally:
        runner.fused = fused
    return fast, reference


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [[0, 1, 2], [5, 1, 3]], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_fused_forward_matches_the_module_forward(models, arch, slots, kernels, request):
    """The fused forward in torch, and through the compiled CPU kernels (cpu_kernels.cpp), against HF's modules."""
    if kernels:
        request.getfixturevalue("kernels_built")
    model, tok = models[arch]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=8, cpu_kernels=kernels)
    assert (engine.runner.kernels is not None) == kernels
    fast, reference = both_paths(engine.runner, slots, prompts(3, 20, seed=1))
    for a, b in zip(fast, reference):
        assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max()


def test_bmm_attention_matches_sdpa(models):
    model, tok = models["tiny-qwen3"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=8, cpu_kernels=False)
    runner, seqs = engine.runner, prompts(4, 30, seed=2)
    assert runner.bmm_attention  # fp32 on the CPU
    fast = run_steps(runner, [4, 0, 2, 6], seqs)
    runner.bmm_attention = False
    reference = run_steps(runner, [4, 0, 2, 6], seqs)
    for a, b in zip(fast, reference):
        assert torch.allclose(a, b, atol=TOL, rtol=0), (a - b).abs().max()


def perturbed(model: torch.nn.Module, scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()
            if "proj" in n]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_a_weight_sync_reaches_the_fused_weights(models, kernels, request):
    if kernels:
        request.getfixturevalue("kernels_built")
    model, tok = models["tiny-qwen3"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4, cpu_kernels=kernels)
    seqs = prompts(2, 16, seed=4)
    before = run_steps(engine.runner, [0, 1], seqs)[-1]
    asyncio.run(engine.update_weights(perturbed(model, 0.05), version=1))
    fast, reference = both_paths(engine.runner, [0, 1], seqs)
    assert (fast[-1] - before).abs().max() > 1e-2  # the new weights are in use...
    assert torch.allclose(fast[-1], reference[-1], atol=TOL, rtol=0)  # ...in the fused path too


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_new_parameter_storage_is_refused_again(models, kernels, request):
    """``model.to`` off the device and back gives every parameter new storage: the next forward re-fuses
    from it instead of reading the old fused tensors."""
    if kernels:
        request.getfixturevalue("kernels_built")
    model, tok = models["tiny-qwen3"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4, cpu_kernels=kernels)
    runner, seqs = engine.runner, prompts(2, 16, seed=5)
    new = dict(perturbed(model, 0.05))
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            p.data = new[name].clone() if name in new else p.data.clone()  # fresh storage, as .to() gives
    fast, reference = both_paths(runner, [0, 1], seqs)
    assert all(block.aliased() for block in runner.fused.qkv)
    assert torch.allclose(fast[-1], reference[-1], atol=TOL, rtol=0)
    fresh = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4)
    asyncio.run(fresh.update_weights(list(new.items()), version=1))
    assert torch.allclose(fast[-1], run_steps(fresh.runner, [0, 1], seqs)[-1], atol=TOL, rtol=0)


def test_a_projection_wrapped_later_turns_the_fused_path_off(models):
    """LoRA (or a quantized layer) installed after the engine was built computes more than ``x @ w``: the
    runner must notice and go back to the modules rather than skip the adapter."""
    from miles_agent.engines.embedded import lora as engine_lora

    model, tok = models["tiny-qwen3"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4)
    assert engine.runner.fused is not None
    rows = engine_lora.install(engine.model, ["a"], 4, 2.0, ["q_proj", "v_proj"])
    engine_lora.attach(engine, rows)
    for name, p in engine.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a non-zero adapter, so skipping it would show
    sampling = SamplingParams(max_new_tokens=6, temperature=0, lora_path="a")
    out = asyncio.run(engine.generate(prompts(1, 12, seed=6)[0], sampling))
    assert engine.runner.fused is None and "wrapped" in engine.runner.unfused_reason
    assert not engine.runner._use_kernels()  # the kernels read the fused weights: off too
    base = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=4)
    plain = asyncio.run(base.generate(prompts(1, 12, seed=6)[0], SamplingParams(max_new_tokens=6, temperature=0)))
    assert out.output_logprobs != plain.output_logprobs


def test_true_on_policy_is_never_fused(models):
    model, tok = models["tiny-qwen3"]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, max_batch_size=2, true_on_policy=True)
    assert engine.runner.fused is None and "on-policy" in engine.runner.unfused_reason


def test_uniform_blocks_are_the_draws_one_step_at_a_time():
    blocked = Uniforms(torch.Generator().manual_seed(11))
    one_by_one = torch.Generator().manual_seed(11)
    drawn = [blocked.next() for _ in range(Uniforms.block * 2 + 5)]
    assert drawn == [float(torch.rand(1, generator=one_by_one)) for _ in drawn]
