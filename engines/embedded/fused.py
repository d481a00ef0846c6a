"""The embedded engine's fused decoder forward: the same Qwen3 math in about half the torch calls.

Why: a small model on a CPU (or any model at a small batch) is dispatch-bound -- HF's modules spend most
of a decode step launching tiny ops (an RMSNorm is six, RoPE eight, each projection its own matmul).
This forward runs the same arithmetic with fewer launches:

- q, k and v are one matmul, and so are the MLP's gate and up (their weights concatenated);
- the q- and k-norms run as one ``rms_norm`` over all heads, then each head's weight;
- RoPE reads a cos / sin table built once by the model's own rotary module (every position it will
  serve), and ``rotate_half(x) * sin`` becomes ``roll(x) * sin`` with sin's first half negated;
- modules are not called: their weights are read directly.

Every elementwise op is HF's, in HF's order (``rms_norm`` is bitwise HF's RMSNorm in fp32; other dtypes
use HF's formula), and a concatenated matmul computes each output from the same row of weights; only
the decode attention kernel differs (model_runner's ``_bmm_attention``), so logits match the module path
to float rounding (tests/perf_engine/test_fused_forward.py pins the tolerance).

Weights stay the model's: after fusing, each projection's ``weight`` is a contiguous view into its fused
tensor, so a weight sync that copies (or receives) into ``q_proj.weight`` by name, by any transport,
updates the fused tensor too -- nothing can go stale. Anything that gives a parameter new storage instead (``model.to``
moving it off the device and back) breaks the aliasing; every forward checks it (a data pointer per
projection) and re-fuses when it is broken.

Used when the model is a text Qwen3 / Qwen3-MoE with plain ``nn.Linear`` projections and a static RoPE;
LoRA or low-precision rollouts (which wrap the projections), true on-policy mode (its batch-invariant
kernels), and vision-language models keep the module path (`ModelRunner._forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MLP = Callable[[nn.Module, torch.Tensor, list | None], torch.Tensor]

_FUSABLE_TYPES = ("qwen3", "qwen3_moe")
TRANSPOSED_COPIES_MAX_BYTES = 256 << 20  # see FusedDecoder.transposed_copies


def fusable(model: nn.Module, layers: list[nn.Module]) -> str | None:
    """None when the fused forward serves this model, else why not (for the engine's stats and tests)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in _FUSABLE_TYPES:
        return f"model_type {model_type!r} (fused: {', '.join(_FUSABLE_TYPES)})"
    rope = getattr(model.model, "rotary_emb", None)
    rope_type = str(getattr(rope, "rope_type", "default"))
    if rope is None or "dynamic" in rope_type or rope_type == "longrope":
        return f"RoPE type {rope_type!r} depends on the sequence length"
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if not hasattr(mlp, "experts"):
            projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        for proj in projections:
            if type(proj) is not nn.Linear:  # LoRA / quantized wrappers compute more than weight @ x
                return f"layer {i} has a {type(proj).__name__} projection"
        if len({p.bias is None for p in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1:
            return f"layer {i}: q/k/v disagree on having a bias"
        if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            return f"layer {i}: the q- and k-norms have different epsilons"
    return None


def _is_silu(act: nn.Module) -> bool:
    """torch's SiLU or transformers' ``SiLUActivation`` (what ``hidden_act="silu"`` builds): both are F.silu."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's Qwen3RMSNorm: fp32 statistics, then ``weight * x.to(input dtype)``."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # bitwise HF's formula in fp32
    normed = x.float()
    normed = (normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


class _FusedBlock:
    """One projection group (or a single projection) as one weight whose row blocks are the modules'
    weights: one matmul for the group. The blocks stay contiguous, so a weight sync receives straight into
    them (a transposed layout ran the GEMM faster at a few rows but made every sync a strided copy)."""

    def __init__(self, modules: list[nn.Linear]) -> None:
        self.modules = modules
        self.weight, self.bias = self._fuse()
        self._transposed: torch.Tensor | None = None
        self._transposed_key: tuple = ()

    @torch.no_grad()
    def _fuse(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(self.modules) == 1:  # nothing to concatenate: the module's own tensors
            weight, bias = self.modules[0].weight, self.modules[0].bias
        else:
            with torch.inference_mode(False):  # the fused tensor must accept later in-place syncs
                weight = torch.cat([m.weight.detach() for m in self.modules])
                bias = None if self.modules[0].bias is None else torch.cat([m.bias.detach() for m in self.modules])
                row = 0
                for m in self.modules:
                    n = m.weight.shape[0]
                    m.weight.data = weight[row: row + n]
                    if bias is not None:
                        m.bias.data = bias[row: row + n]
                    row += n
        # What `aliased` compares: each module's parameter objects and where their data lives now.
        self._expected = [(m._parameters[key], m._parameters[key].data_ptr())
                          for m in self.modules for key in ("weight", "bias") if m._parameters.get(key) is not None]
        return weight, bias

    def aliased(self) -> bool:
        """Each module still holds the parameters fused, over the same storage (checked every forward, so
        it reads the dicts directly: nn.Module attribute lookups cost more than the check)."""
        params = [m._parameters[key] for m in self.modules for key in ("weight", "bias")
                  if m._parameters.get(key) is not None]
        return len(params) == len(self._expected) and all(
            p is q and p.data_ptr() == ptr for p, (q, ptr) in zip(params, self._expected))

    def refresh(self) -> None:
        if not self.aliased():
            self.weight, self.bias = self._fuse()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def transposed(self, epoch: int, copy: bool) -> torch.Tensor:
        """The weight as [in, out] for the CPU kernels: with ``copy``, a contiguous transposed copy (MKL
        multiplies it 1.4-2x faster at a few rows), made again whenever the weights may have changed: a new
        ``epoch`` (the runner counts every weight load, which every sync transport ends with), a parameter's
        version counter (any in-place write through torch) or its storage; else the weight's transposed view."""
        if not copy:
            return self.weight.t()
        key = (epoch, self.weight.data_ptr(), *(p._version for p, _ in self._expected))
        if self._transposed_key != key:
            self._transposed, self._transposed_key = self.weight.detach().t().contiguous(), key
        return self._transposed


class FusedDecoder:
    """The decoder stack of a text Qwen3 / Qwen3-MoE, fused (see module docstring)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], head_dim: int, max_seq_len: int) -> None:
        self.decoder = model.model
        self.layers = layers
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = model.config.num_key_value_heads
        attn = [layer.self_attn for layer in layers]
        dense = [None if hasattr(layer.mlp, "experts") else layer.mlp for layer in layers]  # MoE: the runner's
        self.qkv = [_FusedBlock([a.q_proj, a.k_proj, a.v_proj]) for a in attn]
        self.o = [_FusedBlock([a.o_proj]) for a in attn]
        self.gate_up = [None if m is None else _FusedBlock([m.gate_proj, m.up_proj]) for m in dense]
        self.down = [None if m is None else _FusedBlock([m.down_proj]) for m in dense]
        self.silu = [m is not None and _is_silu(m.act_fn) for m in dense]
        self._kernel_mlp = self.kernel_blocks()
        # Transposed copies of the projections for the CPU kernels cost their size again: kept for small models,
        # whose decode steps are a few rows through small GEMMs (where the copies pay); a big model's GEMMs are
        # bound by the weights' bytes either way.
        blocks = [b for b in (*self.qkv, *self.o, *self.gate_up, *self.down) if b is not None]
        self.transposed_copies = sum(b.weight.numel() * b.weight.element_size() for b in blocks) <= TRANSPOSED_COPIES_MAX_BYTES
        self._held = self._held_tensors()
        self._args: list[tuple] = []
        self._args_key: tuple = ()
        self._table: torch.Tensor | None = None  # [positions, 2, head_dim]: cos, sin with its first half negated
        self._table_key: tuple = ()

    def intact(self) -> bool:
        """False once a projection module was replaced (LoRA or quantized wrappers installed afterwards):
        the fused weights would then skip what the wrapper adds, so the caller must use the modules."""
        for i, layer in enumerate(self.layers):
            held = layer.self_attn._modules
            if (held["q_proj"], held["k_proj"], held["v_proj"], held["o_proj"]) != (*self.qkv[i].modules,
                                                                                   *self.o[i].modules):
                return False
            if self.gate_up[i] is not None:
                mlp = layer.mlp._modules
                if (mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]) != (*self.gate_up[i].modules,
                                                                          *self.down[i].modules):
                    return False
        return True

    def refresh(self) -> None:
        """Re-fuse any group whose modules no longer alias it (their storage was replaced)."""
        for block in [*self.qkv, *self.o, *self.gate_up, *self.down]:
            if block is not None:
                block.refresh()

    def _rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, T, 1, head_dim] at ``positions``, from a table the model's rotary module
        computed (elementwise, so each entry is bitwise what it returns for that position)."""
        cs = self._rope_table(positions, like)[positions]  # [B, T, 2, D]
        return cs[:, :, 0, None], cs[:, :, 1, None]

    def _rope_table(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[positions, 2, head_dim]: cos, and sin with its first half negated, covering ``positions``."""
        needed = int(positions.max()) + 1
        rotary = self.decoder.rotary_emb
        key = (like.dtype, like.device, rotary.inv_freq.data_ptr(), rotary.inv_freq._version)
        if self._table is None or self._table.shape[0] < needed or key != self._table_key:
            size = needed if self._table is None else max(needed, 2 * self._table.shape[0])
            size = min(max(size, 256), max(self.max_seq_len, needed))
            cos, sin = rotary(like, torch.arange(size, device=like.device)[None])
            half = self.head_dim // 2
            signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
            self._table, self._table_key = torch.stack((cos[0], signed), dim=1), key
        return self._table

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend, routing: list | None,
                moe_mlp: MLP) -> torch.Tensor:
        """Hidden states (before the final norm) for ids [B, T] at positions [B, T]; ``attend`` as in
        `ModelRunner._forward` (q [B, H, T, D], k and v [B, KV, T, D])."""
        self.refresh()
        batch, length = ids.shape
        heads, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = F.embedding(ids, self.decoder.embed_tokens.weight)
        cos, sin = self._rope(positions, h)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            norm = layer.input_layernorm
            x = _rms(h, norm.weight, norm.variance_epsilon)
            qkv = self.qkv[i](x)
            qk = qkv[..., : (heads + kv) * d].view(batch, length, heads + kv, d)
            weights = torch.cat((attn.q_norm.weight.expand(heads, d), attn.k_norm.weight.expand(kv, d)))
            qk = _rms(qk, None, attn.q_norm.variance_epsilon) * weights
            qk = qk * cos + torch.roll(qk, d // 2, -1) * sin  # HF's q * cos + rotate_half(q) * sin
            q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
            v = qkv[..., (heads + kv) * d:].view(batch, length, kv, d).transpose(1, 2)
            out = attend(i, q, k, v).transpose(1, 2).reshape(batch, length, heads * d)
            h = h + self.o[i](out)
            post = layer.post_attention_layernorm
            x = _rms(h, post.weight, post.variance_epsilon)
            gate_up = self.gate_up[i]
            if gate_up is None:
                h = h + moe_mlp(layer, x, routing)
                continue
            gate, up = gate_up(x).chunk(2, dim=-1)
            act = F.silu(gate) if self.silu[i] else layer.mlp.act_fn(gate)
            h = h + self.down[i](act * up)
        return h

    def kernel_blocks(self) -> list[bool]:
        """Per layer: whether `forward_rows` runs its MLP in the CPU kernel (dense, SiLU, no biases)."""
        return [g is not None and self.silu[i] and g.bias is None and self.down[i].bias is None
                for i, g in enumerate(self.gate_up)]

    def _kernel_args(self, epoch: int) -> list[tuple]:
        """Per layer: (layer, the attention block's weights and norms, the o-projection's, the MLP block's), as
        the kernels take them. Rebuilt (after `refresh`) when any tensor they hold may have changed: a new
        weights epoch, or a parameter whose object, storage or version counter differs -- checked every
        forward from the modules' parameter dicts, ~20 us against ~150 for the lookups it saves."""
        key = self._weights_key(epoch)
        if key != self._args_key:
            self.refresh()
            copies, args = self.transposed_copies, []
            for i, layer in enumerate(self.layers):
                attn, norm, post, qkv, o = (layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm,
                                            self.qkv[i], self.o[i])
                attn_args = (norm.weight, norm.variance_epsilon, qkv.transposed(epoch, copies), qkv.bias,
                             attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon)
                mlp_args = ((post.weight, post.variance_epsilon, self.gate_up[i].transposed(epoch, copies),
                             self.down[i].transposed(epoch, copies)) if self._kernel_mlp[i] else ())
                args.append((layer, attn_args, (o.transposed(epoch, copies), o.bias), mlp_args))
            self._args, self._args_key = args, self._weights_key(epoch)
        return self._args

    def _weights_key(self, epoch: int) -> tuple:
        params = [m._parameters[name] for m, name in self._held]
        return (epoch, *map(id, params), *(p.data_ptr() for p in params), *(p._version for p in params))

    def _held_tensors(self) -> list[tuple[nn.Module, str]]:
        """(module, parameter name) of every tensor `_kernel_args` hands the kernels, read from the modules."""
        held = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            modules = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
            for block in (self.qkv[i], self.o[i], self.gate_up[i], self.down[i]):
                modules += block.modules if block is not None else []
            held += [(m, name) for m in modules for name in ("weight", "bias") if m._parameters.get(name) is not None]
        return held

    def forward_rows(self, kernels: Any, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, scaling: float, routing: list | None,
                     moe_mlp: MLP, epoch: int) -> torch.Tensor:
        """Hidden states (before the final norm) [N, hidden] for N token rows, token ``n`` of the sequence in
        KV-cache slot ``slots[n]`` at ``positions[n]``, through the compiled CPU kernels (cpu_kernels.cpp):
        no padding, keys and values written into the cache by the kernel. Rows of one sequence come in
        position order. A MoE layer's MLP (and a dense one the kernel does not cover) runs in torch.
        ``epoch``: the runner's count of weight loads (`_FusedBlock.transposed`)."""
        heads, kv = self.num_heads, self.num_kv_heads
        h = F.embedding(ids, self.decoder.embed_tokens.weight)
        rope = self._rope_table(positions, h)[positions]  # [N, 2, D]
        for i, (layer, attn_args, o_args, mlp_args) in enumerate(self._kernel_args(epoch)):
            h = kernels.attention_block(h, *attn_args, rope, k_cache[i], v_cache[i], slots, positions, *o_args,
                                        scaling, heads, kv)
            if self._kernel_mlp[i]:
                h = kernels.mlp_block(h, *mlp_args)
                continue
            post = layer.post_attention_layernorm
            x = _rms(h, post.weight, post.variance_epsilon)[:, None]  # [N, 1, hidden]: the MoE router's rows
            mlp = moe_mlp(layer, x, routing) if self.gate_up[i] is None else layer.mlp(x)
            h = h + mlp[:, 0]
        return h
