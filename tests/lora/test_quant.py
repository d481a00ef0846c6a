"""Low-precision rollout weights: the quantizers (error bounds, scale shapes, e8m0 exactness, int4 packing),
the engine's QuantLinear (requantized at each sync), and INT4 QAT's straight-through fake quantization."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from miles_agent.config import AlgoConfig, TrainConfig, load_config
from miles_agent.engines.embedded import build_engines
from miles_agent.engines.embedded import quant as q
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.trainers import qat


def weights(n: int = 200, k: int = 320) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, k) * torch.logspace(-3, 0, n)[:, None]  # rows of very different magnitude


def test_fp8_block_scales_cover_128x128_blocks_and_bound_the_error():
    w = weights()
    data, scale = q.fp8_block_quant(w)
    assert data.dtype == torch.float8_e4m3fn and data.shape == w.shape and scale.shape == (2, 3)
    assert scale.dtype == torch.float32
    back = q.fp8_block_dequant(data, scale)
    blocks_amax = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :320] * q.E4M3_MAX
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, absolute <= 2^-9 of the block amax
    err = (back - w).abs()
    assert bool((err <= w.abs() * 2 ** -4 + blocks_amax * 2 ** -9 + 1e-12).all())
    assert data.float().abs().max() <= q.E4M3_MAX  # nothing saturates: the scale maps amax to 448
    assert torch.equal(q.fp8_block_dequant(*q.fp8_block_quant(back)), back)  # idempotent on its own grid


def test_mxfp8_scales_are_exact_powers_of_two_per_32_elements():
    pytest.importorskip("torchao")
    w = weights()
    data, scale = q.mxfp8_quant(w)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (200, 320 // 32)
    exps = scale.float().log2()
    assert torch.equal(exps, exps.round())  # e8m0: a pure power of two, no mantissa
    back = q.mxfp8_dequant(data, scale)
    # dequantization is exact: element times 2^e with no rounding
    manual = (data.float().view(200, 10, 32) * scale.float()[..., None]).view(200, 320)
    assert torch.equal(back, manual)
    block_amax = w.abs().view(200, 10, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(200, 320)
    assert bool(((back - w).abs() <= block_amax * 2 ** -3 + 1e-12).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        q.mxfp8_quant(torch.randn(4, 33))


def test_int4_packs_two_nibbles_per_byte_and_matches_the_fake_quant():
    w = weights(64, 128)
    packed, scale = q.int4_pack(w)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 64) and scale.shape == (64, 128 // q.INT4_GROUP)
    back = q.int4_unpack(packed, scale)
    assert torch.equal(back, q.int4_fake_quant(w))  # the engine's int4 is the trainer's QAT rounding
    codes = (back.view(64, -1, q.INT4_GROUP) / scale[..., None]).round()
    assert codes.min() >= -8 and codes.max() <= 7
    group_amax = w.abs().view(64, -1, q.INT4_GROUP).amax(-1, keepdim=True)
    assert bool(((back - w).view(64, -1, q.INT4_GROUP).abs() <= group_amax / 14 + 1e-7).all())


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "int4"])
def test_engine_layers_requantize_at_each_sync(fmt):
    if fmt == "mxfp8":
        pytest.importorskip("torchao")
    cfg = load_config("tiny-cpu", {"rollout.weight_format": fmt})
    model, tok = build_tiny("tiny-qwen3", seed=0)
    ref = [p.detach().clone() for p in model.parameters()]
    engine = build_engines(cfg, model, tok)[0]
    layers = [m for m in engine.model.modules() if isinstance(m, q.QuantLinear)]
    assert len(layers) == 4 * 7 and all(m.fmt == fmt for m in layers)
    prompt = list(range(60, 90))
    lp = asyncio.run(engine.score(prompt)).input_token_logprobs
    exact, _ = build_tiny("tiny-qwen3", seed=0)
    full = torch.log_softmax(exact(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), -1)
    full = full.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    gap = (torch.tensor(lp) - full).abs().mean().item()
    assert 1e-6 < gap < 0.5, gap  # quantized, yet close
    name, w = next((n, p) for n, p in engine.model.named_parameters() if n.endswith("q_proj.weight"))
    before = layers[0].dequantized_weight().clone()
    engine.runner.load_weights([(name, w.detach() * 0.5)])  # a sync: by name, into the full weight
    after = next(m for n, m in engine.model.named_modules() if n == name.removesuffix(".weight"))
    assert not torch.equal(after.dequantized_weight(), before) or after is not layers[0]
    assert torch.allclose(after.dequantized_weight(), after.weight.float(), rtol=0.2, atol=0.05)
    del ref


def test_bad_formats_are_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.prototype.mx_formats", None)  # as if torchao were missing
    with pytest.raises(UserError, match=r"mxfp8 needs torchao: pip install 'miles-agent\[lora\]'"):
        build_engines(load_config("tiny-cpu", {"rollout.weight_format": "mxfp8"}), *build_tiny("tiny-qwen3"))
    monkeypatch.undo()
    with pytest.raises(UserError, match="weight_format"):
        build_engines(load_config("tiny-cpu", {"rollout.weight_format": "fp4"}), *build_tiny("tiny-qwen3"))
    with pytest.raises(UserError, match="train.qat"):
        qat.check("int3")


def test_int4_qat_forward_rounds_and_backward_passes_straight_through():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    x = torch.randn(3, 64)
    lin.__class__ = qat.Int4QATLinear
    out = lin(x)
    assert torch.allclose(out, torch.nn.functional.linear(x, q.int4_fake_quant(lin.weight), lin.bias))
    out.sum().backward()
    assert torch.allclose(lin.weight.grad, x.sum(0).expand(16, -1))  # d/dW of sum(x W^T) through the STE
    model, tok = build_tiny("tiny-qwen3")
    assert qat.install(model, "int4") == 4 * 7 and type(model.lm_head) is torch.nn.Linear


def test_qat_trainer_scores_like_the_int4_engine():
    from miles_agent.trainers.fsdp2 import FSDP2Trainer
    from miles_agent.types import Trajectory

    model, tok = build_tiny("tiny-qwen3", seed=0)
    engine = build_engines(load_config("tiny-cpu", {"rollout.weight_format": "int4"}), model, tok)[0]
    t = Trajectory(prompt_ids=list(range(60, 70)), task_id="t")
    t.append_model(list(range(70, 80)), [0.0] * 10, weight_version=0, turn=0)
    t.reward = 0.0
    engine_lp = asyncio.run(engine.score(t.tokens)).input_token_logprobs[-10:]
    gaps = {}
    for mode in ("none", "int4"):
        m, _ = build_tiny("tiny-qwen3", seed=0)
        trainer = FSDP2Trainer(m, tok, TrainConfig(qat=mode), AlgoConfig())
        lp = trainer.compute_logprobs([t.validate()])[0]
        gaps[mode] = max(abs(a - b) for a, b in zip(lp, engine_lp))
        trainer.close()
    assert gaps["int4"] < 1e-4 < gaps["none"], gaps
