"""True on-policy mode: the embedded engine and the trainer compute bitwise-identical logprobs.

Why they differ otherwise: the engine decodes one token per sequence against a KV cache, in batches
whose composition changes every step; the trainer runs whole packed sequences. BLAS picks other
blockings for other matrix shapes, SDPA other kernels for prefill and decode, and torch's vectorized
``exp`` differs from its scalar tail by an ulp -- so the same token gets a logprob that differs in the
last bits, and after a few layers in more than the last bits.

How this removes it (on CPU; the same recipe as batch-invariant GPU kernels): every operation whose
result could depend on the batch is replaced by one whose arithmetic is a fixed function of the token's
own values only.

* Matrix products (linear layers, attention scores) go through `det_matmul`: both operands are
  rounded per row to integer multiples of a power of two, so float64 BLAS sums them exactly, in
  whatever order it likes. Other reductions (norms, softmax, attention over values) go through
  `det_sum`: the reduced axis is cut into
  blocks of `BLOCK` from index 0, each block is summed by a fixed pairwise tree of elementwise adds,
  and the block sums are added left to right. Elementwise IEEE adds and multiplies are exact functions
  of their inputs whatever the tensor shape, and trailing zeros (masked keys, padding) never change
  the value, so a query attending to 37 keys gets the same bits in a decode step (37 valid keys of a
  longer cache) as in the trainer's packed row.
* ``exp``, ``log`` and ``rsqrt`` are computed from exact operations (range reduction, polynomials,
  Newton steps) instead of torch's vectorized kernels; rotary cos/sin come from one table built with
  the C library's ``cos``/``sin``.
* `apply` patches a HF Qwen3 / Qwen3-MoE model in place (linear layers, RMSNorms, rotary embedding,
  attention, SiLU, MoE router and experts); the engine's runner calls the same patched modules and
  `attention`, and both sides take logprobs with `log_softmax`.

Gradients: each patched op is a `torch.autograd.Function` whose backward differentiates the ordinary
torch implementation of the same function, so training is unchanged apart from forward rounding.

Cost: float64 GEMMs instead of float32 ones, and the rest is elementwise work that fused kernels
would do faster; `bench/true_on_policy.py` prints the slowdown against the normal mode.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles_agent.errors import UserError

BLOCK = 32  # reduction block (a power of two)
_CHUNK_ELEMS = 1 << 22  # bound on the [B, H, Q, S, D] products attention over values materializes at once


# -- exact-order primitives --------------------------------------------------------------------------

def det_sum(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """Sum over ``dim`` in a fixed order that depends only on the index of each element (see module doc)."""
    out = _sum_leading(x.movedim(dim, 0))
    return out.unsqueeze(dim) if keepdim else out


def _sum_leading(x: Tensor) -> Tensor:
    """`det_sum` over dim 0. The reduced axis leads so that every add runs over long contiguous runs."""
    n = x.shape[0]
    if n % BLOCK:
        x = torch.cat([x, x.new_zeros((BLOCK - n % BLOCK, *x.shape[1:]))])
    x = x.reshape(-1, BLOCK, *x.shape[1:])
    width = BLOCK
    while width > 1:
        width //= 2
        x = x[:, :width] + x[:, width:]
    acc = x[0, 0]
    for j in range(1, x.shape[0]):
        acc = acc + x[j, 0]
    return acc


def _pow2(k: Tensor) -> Tensor:
    """2.0 ** k as float64 for integer tensors k, built from the exponent bits (exact)."""
    return torch.bitwise_left_shift(k.to(torch.int64) + 1023, 52).view(torch.float64)


def _to_integers(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``x ~= q * scale`` per row: q integer-valued float64 with ``|q| <= 2**bits``, scale a power of two
    that depends only on the row's largest magnitude."""
    xd = x.double()
    _, e = torch.frexp(xd.abs().amax(-1, keepdim=True))  # |row| < 2**e
    scale = _pow2(e - bits)
    return torch.round(xd / scale), scale


def det_matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` for x ``[..., K]``, w ``[N, K]``, exact in float64 whatever BLAS does.

    Each row of x and of w is rounded to an integer multiple of a power-of-two quantum (``bits``
    significant bits relative to the row's largest entry, 20-24 bits: float32's 24 bits, a little
    less for long rows). Products of such integers and their sums over K stay below 2**53, so float64
    BLAS computes them exactly in any order, blocking or thread split; scaling back is exact and the
    one rounding to float32 at the end depends only on the two rows.
    """
    k = x.shape[-1]
    bits = min(24, (53 - max(1, math.ceil(math.log2(max(k, 2))))) // 2)
    qx, sx = _to_integers(x.reshape(-1, k), bits)
    qw, sw = _to_integers(w, bits)
    out = (qx @ qw.T) * sx * sw.T
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def det_bmm_nt(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.transpose(-1, -2)`` over leading batch dims, exact as in `det_matmul` (rows scaled alone)."""
    k = a.shape[-1]
    bits = min(24, (53 - max(1, math.ceil(math.log2(max(k, 2))))) // 2)
    qa, sa = _to_integers(a, bits)
    qb, sb = _to_integers(b, bits)
    return ((qa @ qb.transpose(-1, -2)) * sa * sb.transpose(-1, -2)).to(a.dtype)


_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 0.693145751953125, 1.4286067653302226e-06


def det_exp(x: Tensor) -> Tensor:
    """exp by Cody-Waite range reduction and a degree-8 Taylor polynomial (about 1 ulp, float32)."""
    x = x.float().clamp(-87.0, 88.0)
    n = torch.floor(x * _LOG2E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, 1.0 / 40320)
    for c in (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0):
        p = p * r + c
    scale = torch.bitwise_left_shift(n.to(torch.int32) + 127, 23).view(torch.float32)
    return p * scale


def det_log(x: Tensor) -> Tensor:
    """log of positive normal floats: frexp, then 2 atanh((m-1)/(m+1)) as an odd series."""
    m, e = torch.frexp(x.float())
    small = m < 0.70710678
    m = torch.where(small, m * 2.0, m)
    e = torch.where(small, e - 1, e).float()
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, 1.0 / 13)
    for c in (1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0):
        p = p * s2 + c
    return (2.0 * s * p + e * _LN2_HI) + e * _LN2_LO


def det_rsqrt(x: Tensor) -> Tensor:
    """1/sqrt(x) for positive x: the integer-shift first guess, then four Newton steps."""
    x = x.float()
    y = (0x5F3759DF - torch.bitwise_right_shift(x.view(torch.int32), 1)).view(torch.float32)
    for _ in range(4):
        y = y * (1.5 - (0.5 * x) * (y * y))
    return y


def det_softmax(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """Softmax over the last axis; entries where ``valid`` is False get exactly 0."""
    if valid is not None:
        x = x.masked_fill(~valid, float("-inf"))
    e = det_exp(x - x.amax(-1, keepdim=True))  # the max is exact in any order
    if valid is not None:
        e = torch.where(valid, e, 0.0)
    return e / det_sum(e, -1, keepdim=True)


def det_log_softmax(x: Tensor) -> Tensor:
    z = x.float() - x.float().amax(-1, keepdim=True)
    return z - det_log(det_sum(det_exp(z), -1, keepdim=True))


def det_silu(x: Tensor) -> Tensor:
    return x / (1.0 + det_exp(-x)).to(x.dtype)


def det_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """Causal attention ``[B, H, Q, D]`` over keys ``[B, Hkv, S, D]`` at positions ``0..S-1``: a query at
    position p sees keys 0..p; keys past p (padding, stale cache) contribute exact zeros."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    b, h, nq, d = q.shape
    s = k.shape[2]
    keys = torch.arange(s, device=q.device)
    valid = (keys[None, None, :] <= q_pos.reshape(-1, nq)[:, :, None].expand(b, nq, s))[:, None]  # [B,1,Q,S]
    step = max(1, _CHUNK_ELEMS // max(1, b * h * s * d))
    outs = []
    for i in range(0, nq, step):
        qc, vc = q[:, :, i:i + step], valid[:, :, i:i + step]
        scores = det_bmm_nt(qc, k) * scale
        w = det_softmax(scores, vc.expand_as(scores))
        outs.append(det_sum(w[..., None] * v[:, :, None], -2))
    return torch.cat(outs, dim=2)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """The same function with torch's kernels (used for gradients)."""
    s = k.shape[2]
    valid = torch.arange(s, device=q.device)[None, None, :] <= q_pos.reshape(q.shape[0], -1)[:, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None], scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# -- autograd: exact forward, ordinary backward ---------------------------------------------------------

class _Exact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, det_fn: Callable, ref_fn: Callable, *inputs: Tensor) -> Tensor:  # noqa: ANN001
        ctx.ref_fn = ref_fn
        ctx.save_for_backward(*inputs)
        return det_fn(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.ref_fn(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs])


def exact(det_fn: Callable[..., Tensor], ref_fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    """``det_fn(*inputs)``; when gradients are needed, they are those of ``ref_fn`` (the same function)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _Exact.apply(det_fn, ref_fn, *inputs)
    return det_fn(*inputs)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    out = exact(det_matmul, lambda a, w: a @ w.T, x, weight)
    return out if bias is None else out + bias


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    return exact(lambda a, b, c: det_attention(a, b, c, q_pos, scale),
                 lambda a, b, c: ref_attention(a, b, c, q_pos, scale), q, k, v)


def log_softmax(x: Tensor) -> Tensor:
    return exact(det_log_softmax, lambda a: torch.log_softmax(a.float(), -1), x)


# -- patching a HF Qwen3 / Qwen3-MoE model -----------------------------------------------------------

def _linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, self.weight, self.bias)


def _rmsnorm_forward(self: nn.Module, x: Tensor) -> Tensor:
    eps, dtype = self.variance_epsilon, x.dtype

    def det(a: Tensor) -> Tensor:
        a = a.float()
        return (a * det_rsqrt(det_sum(a * a, -1, keepdim=True) / a.shape[-1] + eps)).to(dtype)

    def ref(a: Tensor) -> Tensor:
        a = a.float()
        return (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    return self.weight * exact(det, ref, x)


class _SiLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return exact(det_silu, F.silu, x)


class _RopeTable:
    """cos/sin per (position, frequency) from libm, grown on demand: identical for every caller."""

    def __init__(self, inv_freq: Tensor, scaling: float) -> None:
        self.inv_freq = inv_freq.detach().float().cpu().numpy()
        self.scaling = float(scaling)
        self.cos = self.sin = torch.zeros((0, 2 * len(self.inv_freq)))

    def lookup(self, position_ids: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        need = int(position_ids.max()) + 1 if position_ids.numel() else 1
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0], 64))
        idx = position_ids.cpu()
        cos, sin = self.cos[idx], self.sin[idx]
        return cos.to(like.device, like.dtype), sin.to(like.device, like.dtype)

    def _grow(self, length: int) -> None:
        # float32 angles exactly as HF forms them (inv_freq * position), then libm cos/sin per element
        angles = (np.arange(length, dtype=np.float32)[:, None] * self.inv_freq[None, :]).astype(np.float64)
        cos = np.array([[math.cos(a) for a in row] for row in angles.tolist()]) * self.scaling
        sin = np.array([[math.sin(a) for a in row] for row in angles.tolist()]) * self.scaling
        self.cos = torch.from_numpy(np.concatenate([cos, cos], -1).astype(np.float32))
        self.sin = torch.from_numpy(np.concatenate([sin, sin], -1).astype(np.float32))


def _rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    return self._exact_rope.lookup(position_ids, x)


def _attention_forward(self: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                       attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                       **_: object) -> tuple[Tensor, None]:
    """HF attention with `attention` as the kernel; right padding needs no mask (causality hides it)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    batch, length = hidden_states.shape[:2]
    shape = (batch, length, -1, self.head_dim)
    q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
    k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    if position_ids is None:
        position_ids = torch.arange(length, device=hidden_states.device)[None]
    out = attention(q, k, v, position_ids.expand(batch, length), self.scaling)
    return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), None


def _router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """HF's top-k router with exact softmax and normalization (top-k itself is an exact selection)."""
    logits = linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = exact(lambda a: det_softmax(a.float()), lambda a: torch.softmax(a.float(), -1), logits)
    top, ids = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = exact(lambda t: t / det_sum(t, -1, keepdim=True), lambda t: t / t.sum(-1, keepdim=True), top)
    return logits, top.to(logits.dtype), ids


def _experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """HF's expert loop; each token's expert outputs are summed in slot order (a fixed order per token)."""
    slots = hidden_states.new_zeros((*top_k_index.shape, hidden_states.shape[-1]))  # [T, top_k, H]
    for e in top_k_index.unique().tolist():
        token_idx, slot = torch.where(top_k_index == e)
        gate, up = linear(hidden_states[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token_idx, slot, None]
        slots = slots.index_put((token_idx, slot), h.to(slots.dtype))
    out = slots[:, 0]
    for j in range(1, slots.shape[1]):
        out = out + slots[:, j]
    return out


def apply(model: nn.Module) -> nn.Module:
    """Patch ``model`` (HF Qwen3 / Qwen3-MoE) in place for true on-policy numerics; idempotent."""
    if getattr(model, "_true_on_policy", False):
        return model
    cfg = model.config
    if getattr(cfg, "model_type", None) not in ("qwen3", "qwen3_moe") or getattr(cfg, "hidden_act", "silu") != "silu":
        raise UserError(f"algo.true_on_policy supports Qwen3 / Qwen3-MoE models with SiLU; got model_type "
                        f"{getattr(cfg, 'model_type', None)!r}; set algo.true_on_policy=false")
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)
        elif name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm_forward, module)
        elif name.endswith("RotaryEmbedding"):
            module._exact_rope = _RopeTable(module.inv_freq, getattr(module, "attention_scaling", 1.0))
            module.forward = types.MethodType(_rotary_forward, module)
        elif name.endswith("Attention") and hasattr(module, "q_proj"):
            module.forward = types.MethodType(_attention_forward, module)
        elif name.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_forward, module)
        elif name.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = types.MethodType(_experts_forward, module)
        if hasattr(module, "act_fn"):
            module.act_fn = _SiLU()
    model._true_on_policy = True
    return model
