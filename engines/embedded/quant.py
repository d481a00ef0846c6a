"""Low-precision rollout weights in the embedded engine (``rollout.weight_format``), quantized at each sync.

- ``fp8``: e4m3 weights with one fp32 scale per 128x128 block and activations with one per 1x128 group
  (DeepSeek-V3's recipe). CUDA: ``torch._scaled_mm`` with those block scales where the device takes them
  (Hopper and newer); elsewhere -- and on CPU -- the same two quantized operands dequantized and multiplied,
  so the rounding is the same and only the summation order differs.
- ``mxfp8``: OCP MX, e4m3 elements in blocks of 32 along the input dimension with a power-of-two e8m0
  scale each, weights and activations (torchao's ``to_mx`` / ``to_dtype``: its CPU path is exact).
- ``int4``: weight-only, symmetric int4 in groups of ``INT4_GROUP`` input elements with one scale each,
  packed two nibbles per byte; dequantized per matmul (the trainer's QAT fake-quant: trainers/qat.py).

``install`` swaps every decoder ``nn.Linear`` (not the LM head or embeddings) for a ``QuantLinear`` that keeps
the synced ``weight`` under its own name, so every transport's by-name load is unchanged, and requantizes
it when its in-place version counter moves (every ``copy_`` of a sync bumps it): automatic per sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FORMATS = ("auto", "bf16", "fp8", "mxfp8", "int4")
E4M3_MAX = 448.0
FP8_BLOCK = 128
MX_BLOCK = 32
INT4_GROUP = 32


# -- FP8, 128x128 blocks (weights) and 1x128 groups (activations) --------------------------------------
def _pad_to(x: Tensor, rows: int, cols: int) -> Tensor:
    return F.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def fp8_block_quant(w: Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[Tensor, Tensor]:
    """(e4m3 [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]): each block divided by amax/448 and rounded."""
    bn, bk = block
    n, k = w.shape[-2:]
    rn, rk = math.ceil(n / bn), math.ceil(k / bk)
    blocks = _pad_to(w.float(), rn * bn, rk * bk).view(rn, bn, rk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(rn * bn, rk * bk)[:n, :k], scale


def fp8_block_dequant(q: Tensor, scale: Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> Tensor:
    bn, bk = block
    n, k = q.shape
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return q.float() * full


# -- MXFP8: 32-element blocks, e8m0 scales (torchao) --------------------------------------------------
def _mx() -> Any:
    try:
        from torchao.prototype.mx_formats import mx_tensor
    except ImportError:
        from miles_agent.errors import UserError

        raise UserError("rollout.weight_format=mxfp8 needs torchao: pip install 'miles-agent[lora]' "
                        "(or pip install torchao), or pick rollout.weight_format=fp8") from None
    return mx_tensor


def mxfp8_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 elements like ``x``, e8m0 scales [..., K/32]) along the last dimension."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"mxfp8 needs the input dimension to be a multiple of {MX_BLOCK}, got {x.shape[-1]}")
    scale, data = _mx().to_mx(x.float().contiguous(), torch.float8_e4m3fn, MX_BLOCK)
    return data, scale.view(*x.shape[:-1], -1)


def mxfp8_dequant(data: Tensor, scale: Tensor) -> Tensor:
    return _mx().to_dtype(data, scale.reshape(-1), torch.float8_e4m3fn, MX_BLOCK, torch.float32)


# -- INT4: packed nibbles + group scales --------------------------------------------------------------
def int4_fake_quant(w: Tensor, group: int = INT4_GROUP) -> Tensor:
    """``w`` rounded to symmetric int4 per group of ``group`` input elements (values in [-8, 7] x scale)."""
    q, scale = _int4_codes(w, group)
    return (q.float() * scale).view_as(w).to(w.dtype)


def _int4_codes(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    if w.shape[-1] % group:
        raise ValueError(f"int4 needs the input dimension to be a multiple of {group}, got {w.shape[-1]}")
    g = w.float().reshape(*w.shape[:-1], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.0
    return torch.clamp(torch.round(g / scale), -8, 7).to(torch.int8), scale


def int4_pack(w: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """(uint8 [N, K/2], two's-complement nibbles, low nibble first; fp32 scales [N, K/group])."""
    q, scale = _int4_codes(w, group)
    u = (q.reshape(w.shape[0], -1) & 0xF).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4), scale.squeeze(-1)


def int4_unpack(packed: Tensor, scale: Tensor, group: int = INT4_GROUP) -> Tensor:
    lo, hi = (packed & 0xF).to(torch.int8), (packed >> 4).to(torch.int8)
    q = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    q = torch.where(q > 7, q - 16, q)
    return (q.float().view(q.shape[0], -1, group) * scale[..., None]).view(q.shape[0], -1)


# -- the engine's linear layer ------------------------------------------------------------------------
def _scaled_mm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype) -> Tensor | None:
    """The real FP8 GEMM (CUDA, block scales); None where this device or torch build refuses them."""
    try:
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError, ValueError):
        return None


class QuantLinear(nn.Module):
    """``nn.Linear`` computing with its weight in ``fmt``; the full ``weight`` is what syncs write into."""

    def __init__(self, base: nn.Linear, fmt: str) -> None:
        super().__init__()
        if fmt not in ("fp8", "mxfp8", "int4"):
            raise ValueError(f"QuantLinear formats are fp8, mxfp8 and int4, got {fmt!r}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias, self.fmt = base.weight, base.bias, fmt
        self._seen: tuple[int, int] | None = None
        self._q: tuple[Tensor, Tensor] = ()  # type: ignore[assignment]
        self.use_scaled_mm = True  # CUDA only; turned off after the first refusal

    def refresh(self) -> None:
        """Requantize if the weight changed since the last time (a sync copied into it)."""
        stamp = (self.weight._version, self.weight.data_ptr())
        if stamp == self._seen:
            return
        w = self.weight.detach()
        self._q = {"fp8": fp8_block_quant, "mxfp8": mxfp8_quant, "int4": int4_pack}[self.fmt](w)
        self._seen = stamp

    def dequantized_weight(self) -> Tensor:
        self.refresh()
        q, s = self._q
        return {"fp8": fp8_block_dequant, "mxfp8": mxfp8_dequant, "int4": int4_unpack}[self.fmt](q, s)

    def forward(self, x: Tensor) -> Tensor:
        self.refresh()
        if self.fmt == "int4":  # weight-only
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        flat = x.reshape(-1, x.shape[-1])
        if self.fmt == "fp8":
            xq, xs = fp8_block_quant(flat, (1, FP8_BLOCK))
            if flat.is_cuda and self.use_scaled_mm:
                out = _scaled_mm_fp8(xq, xs, *self._q, out_dtype=x.dtype)
                if out is not None:
                    out = out if self.bias is None else out + self.bias
                    return out.view(*x.shape[:-1], -1)
                self.use_scaled_mm = False
            xd = fp8_block_dequant(xq, xs, (1, FP8_BLOCK))
        else:
            xd = mxfp8_dequant(*mxfp8_quant(flat)).view_as(flat)
        out = F.linear(xd, self.dequantized_weight(), None).to(x.dtype)
        out = out if self.bias is None else out + self.bias
        return out.view(*x.shape[:-1], -1)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        from miles_agent.errors import UserError

        raise UserError(f"rollout.weight_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def install(model: nn.Module, fmt: str) -> int:
    """Swap the decoder's linear layers for ``QuantLinear`` in ``fmt`` (bf16: the model cast to bfloat16; auto:
    nothing); returns how many layers now compute in ``fmt``."""
    if check_format(fmt) == "bf16":
        model.to(torch.bfloat16)
    if fmt in ("auto", "bf16"):
        return 0
    if fmt == "mxfp8":
        _mx()  # a missing torchao is refused when the engine is built, not at its first forward
    layers = model.get_submodule("model.layers")
    found = [(n, m) for n, m in layers.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in found:
        parent, _, attr = name.rpartition(".")
        setattr(layers.get_submodule(parent) if parent else layers, attr, QuantLinear(linear, fmt))
    return len(found)
