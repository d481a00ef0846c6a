"""The embedded engine's model runner: a Qwen3 / Qwen3-MoE forward over the HF module weights with its own KV cache.

Why not call the HF module's ``forward``: continuous batching needs a per-sequence KV cache that
sequences join and leave at every step, with a different length per row; HF's cache classes are
built for one ``generate`` call. So the runner re-implements the decoder loop, calling HF's own
leaf modules (linear layers, RMSNorms, rotary embedding, the sparse-MoE router and experts) so the
fp32 numerics match HF's forward. A text Qwen3 runs the same math fused into fewer torch calls
(`miles_agent.engines.embedded.fused`) unless true on-policy mode or wrapped projections forbid it, and on a
CPU in fp32 through compiled kernels over unpadded token rows (`cpu_kernels.cpp`) when they build.
Attention is SDPA with an explicit mask or, over the cache in fp32 on a CPU, two batched matmuls
(`_bmm_attention`).

The cache is preallocated per slot -- values ``[layers, slots, kv_heads, capacity, head_dim]``, keys
transposed, ``[layers, slots, kv_heads, head_dim, capacity]``, so a decode step's ``q @ k^T`` streams
each key row in order -- and grows (doubling) in both slots and capacity up to the engine's limits, so a
tiny model on a laptop does not reserve ``max_batch_size x max_seq_len`` up front.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from miles_agent.engines.embedded.fused import FusedDecoder, _is_silu, fusable
from miles_agent.models.vision import mask_suppressed, suppressed_ids
from miles_agent.transports.core import copy_many_

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl")

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _is_moe(mlp: torch.nn.Module) -> bool:
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def _experts_kernel_fits(experts: torch.nn.Module) -> bool:
    """HF's Qwen3-MoE experts as built (not wrapped or quantized since): fp32 CPU weights gate_up [E, 2I, H]
    and down [E, H, I], SiLU -- what the `moe_experts` kernel computes."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    plain = (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass (a quantized or distributed weight)
    return (type(experts).__name__ == "Qwen3MoeExperts" and type(gate_up) in plain and type(down) in plain
            and gate_up.dim() == 3 and down.dim() == 3
            and gate_up.dtype == down.dtype == torch.float32 and gate_up.device.type == down.device.type == "cpu"
            and gate_up.is_contiguous() and down.is_contiguous() and gate_up.shape[1] == 2 * down.shape[2]
            and _is_silu(getattr(experts, "act_fn", None)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb for [B, heads, T, head_dim] tensors, bit for bit (the same elementwise
    ops). A decode step (T = 1) rotates q and k as one tensor: half the tiny kernel launches."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if q.shape[2] == 1:
        x = torch.cat((q, k), dim=1)
        x = x * cos + _rotate_half(x) * sin
        return x[:, : q.shape[1]], x[:, q.shape[1]:]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _run_start(slots: list[int]) -> int | None:
    """The first slot when ``slots`` are consecutive (the cache is then read through a view), else None."""
    return slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None


class VisionInputs:
    """One prompt's image inputs for the runner: M-RoPE positions ``rope`` [3, prompt_len], the ``delta`` of
    positions after the prompt, and the image columns with their features (and DeepStack features)."""

    def __init__(self, rope: torch.Tensor, delta: int, cols: torch.Tensor, feats: torch.Tensor,
                 deep: list[torch.Tensor]) -> None:
        self.rope, self.delta, self.cols, self.feats, self.deep = rope, delta, cols, feats, deep

    def window(self, start: int, length: int) -> tuple[torch.Tensor, tuple | None]:
        """Rotary positions of positions ``start:start+length`` and the image rows among them, re-indexed."""
        pos = torch.arange(start, start + length, device=self.rope.device)
        n = self.rope.shape[1]
        rope = torch.where(pos < n, self.rope[:, pos.clamp(max=n - 1)], pos + self.delta)
        keep = (self.cols >= start) & (self.cols < start + length)
        if not bool(keep.any()):
            return rope, None
        return rope, (self.cols[keep] - start, self.feats[keep], [d[keep] for d in self.deep])


class ModelRunner:
    """Prefill and batched decode over per-slot KV cache. Not thread-safe: one step at a time."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_seq_len: int, max_slots: int,
                 exact: bool = False, cpu_kernels: bool | None = None) -> None:
        cfg = model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"EmbeddedEngine serves {', '.join(SUPPORTED_MODEL_TYPES)} models; got model_type "
                             f"{model_type!r} ({type(model).__name__})")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("EmbeddedEngine does not implement sliding-window attention; "
                             "set use_sliding_window=False in the model config")
        self.model = model.to(device).eval()
        self.device = device
        self.config = cfg
        cfg = getattr(cfg, "text_config", None) or cfg  # a vision-language model: its decoder's config
        self.decoder = getattr(model.model, "language_model", model.model)
        self.layers = list(self.decoder.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.vocab_size = cfg.vocab_size
        self.moe_layers = [i for i, layer in enumerate(self.layers) if _is_moe(layer.mlp)]
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0)) if self.moe_layers else 0
        self.max_seq_len = max_seq_len
        self.max_slots = max_slots
        self.dtype = next(model.parameters()).dtype
        self.k_cache = self._empty(0, 0, keys=True)
        self.v_cache = self._empty(0, 0)
        ids = suppressed_ids(model)  # a VLM never samples image placeholders (nor does its trainer score them)
        self.suppressed = torch.tensor(ids, device=device) if ids else None
        self.exact = exact  # true on-policy mode (miles_agent.true_on_policy): the trainer's kernels, unfused
        # Attention over the cache as two batched matmuls (`_bmm_attention`) where that beats SDPA's kernel: fp32
        # on a CPU. Elsewhere (bf16, CUDA) SDPA keeps its fp32 softmax and fused kernels.
        self.bmm_attention = self.device.type == "cpu" and self.dtype == torch.float32
        # The fused forward (fewer, larger torch ops; same math) where the model allows it, else why not.
        self.unfused_reason = "true on-policy mode runs the trainer's kernels" if exact else fusable(self.model,
                                                                                                    self.layers)
        self.fused = (FusedDecoder(self.model, self.layers, self.head_dim, max_seq_len)
                      if self.unfused_reason is None else None)
        # The compiled CPU kernels (cpu_kernels.cpp) run the fused forward over token rows: a CPU in fp32 only
        # (None: wherever they apply and build; False: never; True: say why not when they can't).
        self.weights_epoch = 0  # weight loads so far (`load_weights`): derived copies of the weights key on it
        self.kernels, self.kernels_reason = None, self._kernels_unavailable(cpu_kernels)
        if self.kernels_reason is None:
            from miles_agent.engines.embedded import cpu_kernels as compiled

            self.kernels = compiled.load()
            self.kernels_reason = None if self.kernels is not None else compiled.unavailable_reason()
        if cpu_kernels and self.kernels is None:
            raise ValueError(f"cpu_kernels=True but the embedded engine's CPU kernels cannot run here: "
                             f"{self.kernels_reason}")

    def _kernels_unavailable(self, wanted: bool | None) -> str | None:
        if wanted is False:
            return "turned off (cpu_kernels=False)"
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return f"they serve float32 on a CPU, not {self.dtype} on {self.device.type}"
        return self.unfused_reason

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    # -- cache ----------------------------------------------------------------------------------
    def _empty(self, slots: int, length: int, keys: bool = False) -> torch.Tensor:
        shape = ((len(self.layers), slots, self.num_kv_heads, self.head_dim, length) if keys
                 else (len(self.layers), slots, self.num_kv_heads, length, self.head_dim))
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def ensure_capacity(self, slots: int, length: int) -> None:
        """Grow the cache (doubling, capped at the engine limits) so ``slots`` x ``length`` fits."""
        cur_slots, cur_len = self.v_cache.shape[1], self.v_cache.shape[3]
        if slots <= cur_slots and length <= cur_len:
            return
        new_slots = cur_slots if slots <= cur_slots else min(self.max_slots, max(slots, 2 * cur_slots))
        new_len = cur_len if length <= cur_len else min(self.max_seq_len, max(length, 2 * cur_len, 64))
        keys = self._empty(new_slots, new_len, keys=True)
        keys[:, :cur_slots, ..., :cur_len] = self.k_cache
        values = self._empty(new_slots, new_len)
        values[:, :cur_slots, :, :cur_len] = self.v_cache
        self.k_cache, self.v_cache = keys, values

    def release(self) -> None:
        """Drop the whole cache (callers re-prefill anything they still need)."""
        self.k_cache = self._empty(0, 0, keys=True)
        self.v_cache = self._empty(0, 0)

    # -- forward ----------------------------------------------------------------------------------
    def _mlp(self, layer: torch.nn.Module, x: torch.Tensor, routing: list[torch.Tensor] | None,
             experts_kernel: bool = False) -> torch.Tensor:
        """A layer's MLP; a MoE layer's exactly as HF's Qwen3MoeSparseMoeBlock.forward. ``experts_kernel`` (the
        kernel forward): HF's experts as built run in one `moe_experts` call (the same ATen ops as HF's loop,
        without its Python per expert); the router stays HF's module either way."""
        mlp = layer.mlp
        if not _is_moe(mlp):
            return mlp(x)
        flat = x.reshape(-1, x.shape[-1])
        _, weights, experts = mlp.gate(flat)
        if routing is not None:
            routing.append(experts.view(*x.shape[:-1], -1))
        if experts_kernel and _experts_kernel_fits(mlp.experts):
            out = self.kernels.moe_experts(flat, experts, weights, mlp.experts.gate_up_proj, mlp.experts.down_proj)
        else:
            out = mlp.experts(flat, experts, weights)
        return out.view_as(x)

    def _mlp_rows(self, layer: torch.nn.Module, x: torch.Tensor, routing: list[torch.Tensor] | None) -> torch.Tensor:
        return self._mlp(layer, x, routing, experts_kernel=True)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                 routing: list[torch.Tensor] | None, rope: torch.Tensor | None = None,
                 visual: list[tuple[int, torch.Tensor, torch.Tensor, list[torch.Tensor]]] = ()) -> torch.Tensor:
        """Hidden states (before the final norm) for ids [B, T] at positions [B, T].

        A vision-language model's rotary positions ``rope`` ([3, B, T] M-RoPE) differ from the cache
        positions; ``visual`` rows ``(b, columns, features, deepstack)`` replace those columns' embeddings
        with image features and add the DeepStack features after the first layers, as HF's forward does."""
        if self.fused is not None and not self.exact and rope is None and not visual:
            if self.fused.intact():
                return self.fused.forward(ids, positions, attend, routing, self._mlp)
            self.fused, self.unfused_reason = None, "a projection was wrapped after the engine was built"
        h = self.decoder.embed_tokens(ids)
        for b, cols, feats, _ in visual:
            h[b, cols] = feats.to(h.dtype)
        cos, sin = self.decoder.rotary_emb(h, positions if rope is None else rope)
        batch, length = ids.shape
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(batch, length, -1, self.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(batch, length, -1, self.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            q, k = _rope(q, k, cos, sin)
            out = attend(i, q, k, v).transpose(1, 2).reshape(batch, length, -1)
            h = h + attn.o_proj(out)
            h = h + self._mlp(layer, layer.post_attention_layernorm(h), routing)
            for b, cols, _, deep in visual:
                if i < len(deep):
                    h[b, cols] += deep[i].to(h.dtype)
        return h

    def _logits(self, hidden: torch.Tensor, rows: bool = False) -> torch.Tensor:
        """float32 logits of hidden states; ``rows``: [N, hidden] from the kernels, normed by theirs."""
        norm = self.decoder.norm
        normed = self.kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon) if rows else norm(hidden)
        logits = self.model.lm_head(normed).float()
        return mask_suppressed(logits, self.suppressed) if self.suppressed is not None else logits

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              q_pos: torch.Tensor) -> torch.Tensor:
        if self.exact:  # true on-policy: the trainer's batch-invariant kernel (masks by position)
            from miles_agent import true_on_policy

            return true_on_policy.attention(q, k, v, q_pos, self.scaling)
        group = self.num_heads // self.num_kv_heads
        if q.shape[2] == 1 and group > 1:
            # One query per sequence (decode): a kv head's `group` query heads become its query rows, so
            # the keys and values are read once per kv head, not repeated per query head (GQA's copy).
            batch, heads, _, dim = q.shape
            out = F.scaled_dot_product_attention(q.reshape(batch, self.num_kv_heads, group, dim), k, v,
                                                 attn_mask=mask, scale=self.scaling)
            return out.view(batch, heads, 1, dim)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                              enable_gqa=group > 1)

    def _attend_cached(self, i: int, q: torch.Tensor, slot_idx: torch.Tensor, first: int | None, span: int,
                       bias: torch.Tensor | None, mask: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention of ``q`` over the first ``span`` cached positions of its slots: read
        through a view when the slots are a run starting at ``first`` (the engine hands out the lowest
        free slots, so they usually are; the gather was a quarter of a decode step), else gathered."""
        if first is not None:
            keys_t = self.k_cache[i, first: first + q.shape[0], ..., :span]
            values = self.v_cache[i, first: first + q.shape[0], :, :span]
        else:
            keys_t = self.k_cache[i, ..., :span].index_select(0, slot_idx)
            values = self.v_cache[i, :, :, :span].index_select(0, slot_idx)
        if bias is not None:
            return self._bmm_attention(q, keys_t, values, bias)
        return self._sdpa(q, keys_t.transpose(-1, -2), values, mask, q_pos)

    def _bias(self, visible: torch.Tensor, length: int) -> torch.Tensor:
        """`_bmm_attention`'s additive mask from a boolean one [B, 1, T or 1, span]: one row per (sequence,
        kv head), and per query row of the kv head's group when there are several queries (prefill)."""
        batch, span = visible.shape[0], visible.shape[-1]
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        group = self.num_heads // self.num_kv_heads if length > 1 else 1
        rows = bias.shape[2] * group
        return bias[:, :, None].expand(batch, self.num_kv_heads, group, -1, span).reshape(-1, rows, span)

    def _bmm_attention(self, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                       bias: torch.Tensor) -> torch.Tensor:
        """Attention against cached keys (transposed, ``[B, KV, D, span]``) as two batched matmuls: a kv
        head's query group is one ``[group x T, D] @ [D, span]`` (no keys repeated per query head, no mask
        converted per layer). On a CPU in fp32 this beats SDPA's kernel, most at one query row (decode)."""
        batch, heads, length, dim = q.shape
        kv, span = keys_t.shape[1], keys_t.shape[-1]
        scores = torch.baddbmm(bias, q.reshape(batch * kv, heads // kv * length, dim),
                               keys_t.reshape(batch * kv, dim, span), alpha=self.scaling)
        out = torch.bmm(scores.softmax(-1), values.reshape(batch * kv, span, dim))
        return out.view(batch, heads, length, dim)

    def _use_kernels(self) -> bool:
        """The compiled kernels serve this forward: loaded, and the fused forward still applies (no LoRA or
        quantized wrapper installed since; true on-policy mode never loads them)."""
        if self.kernels is None or self.fused is None:
            return False
        if not self.fused.intact():
            self.fused, self.unfused_reason = None, "a projection was wrapped after the engine was built"
            return False
        return True

    def _rows(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              routing: list[torch.Tensor] | None) -> torch.Tensor:
        """Hidden states [N, hidden] of N token rows through the compiled kernels (`FusedDecoder.forward_rows`)."""
        return self.fused.forward_rows(self.kernels, ids, slots, positions, self.k_cache, self.v_cache,
                                       self.scaling, routing, self._mlp_rows, self.weights_epoch)

    @staticmethod
    def _routing_rows(routing: list[torch.Tensor] | None) -> np.ndarray | None:
        if not routing:
            return None
        return torch.stack(routing, dim=-2).to(torch.int32).cpu().numpy()  # [..., moe_layers, top_k]

    @torch.inference_mode()
    def prefill(self, slots: list[int], seqs: list[list[int]], record_routing: bool,
                starts: list[int] | None = None, vision: list[VisionInputs | None] | None = None,
                ) -> tuple[torch.Tensor, np.ndarray | None]:
        """Run token spans into their slots, padded to one batch: ``seqs[b]`` goes at positions
        ``starts[b]...``, attending to the slot's cache before it (a cached prefix or an earlier chunk).

        Returns float32 logits of each span's last token [B, V] and, when asked and the model is
        MoE, the routed expert ids int32 [B, T_max, moe_layers, top_k] (rows past a span's length
        are padding).
        """
        starts = starts or [0] * len(seqs)
        if self._use_kernels() and not (vision and any(v is not None for v in vision)):
            return self._prefill_rows(slots, seqs, starts, record_routing)
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        batch, length = len(seqs), max(len(s) for s in seqs)
        span = max(st + len(s) for st, s in zip(starts, seqs))
        self.ensure_capacity(max(slots) + 1, max(span, length))
        ids = torch.tensor([s + [0] * (length - len(s)) for s in seqs], dtype=torch.long, device=self.device)
        offsets = torch.tensor(starts, device=self.device)
        positions = offsets[:, None] + torch.arange(length, device=self.device)[None]
        slot_idx = torch.tensor(slots, device=self.device)
        if any(starts):  # keys come from the cache: write the valid rows, then read each slot's span
            valid_b, valid_t = (torch.arange(length, device=self.device)[None] < lens[:, None]).nonzero(as_tuple=True)
            w_slot, w_pos = slot_idx[valid_b], positions[valid_b, valid_t]
            mask = (torch.arange(span, device=self.device)[None, None] <= positions[:, :, None])[:, None]
            bias = self._bias(mask, length) if self.bmm_attention and not self.exact else None
            first = _run_start(slots)

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                self.k_cache[i, w_slot, :, :, w_pos] = k.transpose(1, 2)[valid_b, valid_t]
                self.v_cache[i, w_slot, :, w_pos] = v.transpose(1, 2)[valid_b, valid_t]
                return self._attend_cached(i, q, slot_idx, first, span, bias, mask, positions)
        else:
            causal = torch.ones((length, length), dtype=torch.bool, device=self.device).tril()
            mask = (causal[None] & (positions < lens[:, None])[:, None, :])[:, None]  # [B, 1, T, T]

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                self.k_cache[i, slot_idx, ..., :length] = k.transpose(-1, -2)
                self.v_cache[i, slot_idx, :, :length] = v
                return self._sdpa(q, k, v, mask, positions)

        routing: list[torch.Tensor] | None = [] if record_routing and self.is_moe else None
        rope, visual = None, []
        if vision and any(v is not None for v in vision):
            rope = positions[None].expand(3, -1, -1).clone()
            for b, v in enumerate(vision):
                if v is not None:
                    rope[:, b, :len(seqs[b])], row = v.window(starts[b], len(seqs[b]))
                    if row is not None:
                        visual.append((b, *row))
        h = self._forward(ids, positions, attend, routing, rope, visual)
        last = h[torch.arange(batch, device=self.device), lens - 1]
        return self._logits(last), self._routing_rows(routing)

    def _prefill_rows(self, slots: list[int], seqs: list[list[int]], starts: list[int],
                      record_routing: bool) -> tuple[torch.Tensor, np.ndarray | None]:
        """`prefill` through the compiled kernels: the spans' tokens as rows, no padding."""
        self.ensure_capacity(max(slots) + 1, max(st + len(s) for st, s in zip(starts, seqs)))
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], device=self.device)
        rows_slot = torch.tensor([slot for slot, n in zip(slots, lens) for _ in range(n)], device=self.device)
        rows_pos = torch.tensor([p for st, n in zip(starts, lens) for p in range(st, st + n)], device=self.device)
        routing: list[torch.Tensor] | None = [] if record_routing and self.is_moe else None
        h = self._rows(ids, rows_slot, rows_pos, routing)
        ends = np.cumsum(lens)
        logits = self._logits(h[torch.from_numpy(ends - 1)], rows=True)
        flat = self._routing_rows(routing)  # [N, 1, moe_layers, top_k]
        if flat is None:
            return logits, None
        padded = np.zeros((len(seqs), max(lens), *flat.shape[2:]), dtype=flat.dtype)  # prefill's [B, T_max, ...]
        for b, (n, end) in enumerate(zip(lens, ends)):
            padded[b, :n] = flat[end - n: end, 0]
        return logits, padded

    @torch.inference_mode()
    def write_prefix(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy a cached prefix's KV ``[layers, kv_heads, n, head_dim]`` into positions ``0:n`` of a slot."""
        n = k.shape[2]
        self.ensure_capacity(slot + 1, n + 1)
        self.k_cache[:, slot, ..., :n] = k.transpose(-1, -2)
        self.v_cache[:, slot, :, :n] = v

    def read_kv(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a slot's KV at positions ``start:end`` (callers copy what they keep)."""
        return self.k_cache[:, slot, ..., start:end].transpose(-1, -2), self.v_cache[:, slot, :, start:end]

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int],
               record_routing: bool, rope_deltas: list[int] | None = None) -> tuple[torch.Tensor, np.ndarray | None]:
        """One token per slot at its position (= the slot's cache length); appends to the cache.

        Returns float32 logits [B, V] and, when asked on a MoE model, int32 routing [B, moe_layers, top_k].
        """
        span = max(positions) + 1
        self.ensure_capacity(max(slots) + 1, span)
        routing: list[torch.Tensor] | None = [] if record_routing and self.is_moe else None
        if self._use_kernels() and not (rope_deltas and any(rope_deltas)):
            ids, rows_slot, rows_pos = torch.tensor([tokens, slots, positions], device=self.device)  # one copy in
            h = self._rows(ids, rows_slot, rows_pos, routing)
            rows = self._routing_rows(routing)
            return self._logits(h, rows=True), (None if rows is None else rows[:, 0])
        pos = torch.tensor(positions, device=self.device)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        visible = torch.arange(span, device=self.device)[None, :] <= pos[:, None]  # [B, span]
        slot_idx = torch.tensor(slots, device=self.device)
        bias = self._bias(visible[:, None, None], 1) if self.bmm_attention and not self.exact else None

        first = _run_start(slots)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k_cache[i, slot_idx, :, :, pos] = k[:, :, 0]
            self.v_cache[i, slot_idx, :, pos] = v[:, :, 0]
            return self._attend_cached(i, q, slot_idx, first, span, bias, visible[:, None, None, :], pos[:, None])

        rope = None
        if rope_deltas and any(rope_deltas):  # after an image, M-RoPE positions run ahead of (or behind) the cache
            rope = (pos + torch.tensor(rope_deltas, device=self.device))[:, None]
        h = self._forward(ids, pos[:, None], attend, routing, rope)
        rows = self._routing_rows(routing)
        return self._logits(h[:, 0]), (None if rows is None else rows[:, 0])

    @torch.inference_mode()
    def score(self, ids: list[int], start: int, temperature: float) -> list[float]:
        """Logprob of ``ids[start:]`` (``start >= 1``), each given the tokens before it, from one causal
        forward that never touches the KV cache (so it runs between decode steps without disturbing them)."""
        length = len(ids)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(length, device=self.device)[None]
        mask = torch.ones((length, length), dtype=torch.bool, device=self.device).tril()[None, None]
        h = self._forward(x, positions, lambda i, q, k, v: self._sdpa(q, k, v, mask, positions), None)
        logits = self._logits(h[0, start - 1:length - 1]) / temperature
        targets = x[0, start:, None]
        if self.exact:  # true on-policy: the trainer's log-softmax, bit for bit
            from miles_agent import true_on_policy

            return true_on_policy.log_softmax(logits).gather(-1, targets).squeeze(-1).tolist()
        return (logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, -1)).tolist()

    @torch.inference_mode()
    def encode_images(self, ids: list[int], image_spans: list[tuple[int, int]], pngs: list[bytes]) -> VisionInputs:
        """A prompt's image features (HF's own vision tower and merger) and M-RoPE positions (HF's
        ``get_rope_index``): the trainer's forward computes both the same way."""
        from miles_agent.models.vision import pixel_inputs

        inner = self.model.model
        pixels, grid = pixel_inputs(pngs)
        out = inner.get_image_features(pixels.to(self.device), grid.to(self.device), return_dict=True)
        feats = torch.cat(out.pooler_output)
        deep = [torch.cat(d) for d in (getattr(out, "deepstack_features", None) or ())]
        x = torch.tensor([ids], device=self.device)
        token_type = (x == self.config.image_token_id).int()
        rope, delta = inner.get_rope_index(x, token_type, grid.to(self.device))
        cols = torch.cat([torch.arange(a, b, device=self.device) for a, b in image_spans])
        if cols.numel() != feats.shape[0]:
            raise ValueError(f"the images have {feats.shape[0]} placeholder tokens after patching but the ids hold "
                             f"{cols.numel()}; expand each <|image_pad|> to placeholder_count(png) tokens")
        return VisionInputs(rope[:, 0], int(delta.reshape(-1)[0]), cols, feats, deep)

    @torch.no_grad()
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], ready: Callable[[], bool] | None = None
                     ) -> bool:
        """Copy tensors into parameters/buffers by HF name; check every name and shape before copying any.
        Every call that copies counts a new weights epoch, an empty one too: a receiver that broadcast straight
        into the parameters ends its sync with one, so copies derived from the weights are made again.
        ``ready``: called after the checks, before the first copy -- blocks until the tensors' bytes are in
        place, False when they will not come (nothing is loaded then). Returns whether it loaded."""
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name not in targets:
                raise ValueError(f"update_weights: the model has no parameter named {name!r}")
            if tuple(targets[name].shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(targets[name].shape)} in the "
                                 f"model but {tuple(tensor.shape)} was sent")
        if ready is not None and not ready():
            return False
        self.weights_epoch += 1
        same = []  # same device and dtype: copied together, host ones on a few threads (the engine is paused)
        for name, tensor in named_tensors:
            target = targets[name]
            if target.device == tensor.device and target.dtype == tensor.dtype:
                same.append((target, tensor))
            else:
                target.copy_(tensor)  # converts as it copies
        copy_many_(same)
        return True
