"""Varlen attention for packed micro-batches: each sequence attends only to itself, at its own cost.

A packed micro-batch (``batching.pack``) is one row of every sequence's real tokens, positions restarting
at each sequence. Given only those ``position_ids``, transformers keeps attention inside each sequence
with a block-diagonal ``[T, T]`` mask (exact, but quadratic in the *whole* row: 64 sequences of 160
tokens make a 10240 x 10240 mask and 64x the attention work of the sequences themselves). On GPU flash
attention takes ``cu_seqlens`` instead; on CPU (and as a fallback on GPU) this module does the same job
with PyTorch's SDPA: the row is cut into its sequences, consecutive sequences of equal length are viewed
as one ``[n, heads, length, dim]`` batch (a view, no copy: ``pack`` orders a micro-batch longest first,
so equal lengths sit together) and each batch runs causal SDPA without any mask.

How: ``install(model)`` registers the attention function ``miles_varlen`` with transformers and sets it as
the model's implementation. Without a ``varlen`` keyword (every unpacked forward: padded rows, the
engine's calls on a shared model) it *is* transformers' SDPA, under SDPA's own masks, so nothing else
changes. A packed forward passes ``**forward_kwargs(model, lengths, device)``: the ``Segments`` and an
all-ones mask, so no ``[T, T]`` mask is ever built. Models whose attention is not plain causal SDPA
(sliding windows, eager or flash attention chosen by the user) are left alone: ``install`` returns
False and packing keeps transformers' own exact path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

NAME = "miles_varlen"


@dataclass(frozen=True)
class Segments:
    """The sequences of a packed row as runs ``(start, count, length)``: ``count`` consecutive sequences
    of ``length`` tokens from packed position ``start``."""

    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Segments:
        runs: list[list[int]] = []
        start = 0
        for n in (int(x) for x in lengths):
            if runs and runs[-1][2] == n:
                runs[-1][1] += 1
            else:
                runs.append([start, 1, n])
            start += n
        return cls(tuple((s, c, n) for s, c, n in runs))

    @property
    def total(self) -> int:
        return sum(c * n for _, c, n in self.runs)


def _sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              varlen: Segments | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface: ``query`` ``[1, heads, T, dim]`` (``key``/``value`` with the KV
    heads) -> ``[1, T, heads, dim]``. With ``varlen``: causal SDPA within each sequence; else plain SDPA."""
    sdpa = _sdpa()
    if varlen is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != varlen.total or key.shape[2] != varlen.total:
        raise ValueError(f"varlen attention over {varlen.total} packed tokens got a query of shape "
                         f"{tuple(query.shape)} and a key of shape {tuple(key.shape)}")
    kwargs.pop("is_causal", None)
    sizes = [count * length for _, count, length in varlen.runs]
    # one split per tensor (its backward is one cat), not a slice per run (each slice's backward would
    # zero-fill a gradient of the whole row)
    parts = zip(*(t[0].split(sizes, dim=1) for t in (query, key, value)))
    outs = []
    for (_, count, length), qkv in zip(varlen.runs, parts):
        q, k, v = (t.unflatten(1, (count, length)).transpose(0, 1) for t in qkv)  # [count, heads, length, dim]
        out, _ = sdpa(module, q, k, v, None, is_causal=True, **kwargs)  # [count, length, heads, dim]
        outs.append(out.reshape(count * length, *out.shape[2:]))
    return (torch.cat(outs) if len(outs) > 1 else outs[0])[None], None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # unpacked forwards: SDPA's masks, unchanged


def _text_configs(model: nn.Module) -> list[Any]:
    cfg = model.config
    return [c for c in (cfg, getattr(cfg, "text_config", None)) if c is not None]


def supported(model: nn.Module) -> bool:
    """Plain causal SDPA (or ours already) on full-attention layers only, text models only."""
    if getattr(model.config, "vision_config", None) is not None:
        return False
    for cfg in _text_configs(model):
        if getattr(cfg, "_attn_implementation", None) not in ("sdpa", NAME):
            return False
        types = getattr(cfg, "layer_types", None)
        if types is not None and any(t != "full_attention" for t in types):
            return False
        if types is None and getattr(cfg, "sliding_window", None) is not None:
            return False
    return True


def install(model: nn.Module) -> bool:
    """Make ``model``'s attention ``miles_varlen`` when it is plain SDPA; returns whether packed forwards
    may pass ``forward_kwargs`` (False: leave them to transformers' block-diagonal mask)."""
    if not supported(model):
        return False
    _register()
    for cfg in _text_configs(model):
        cfg._attn_implementation = NAME
    return True


def installed(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


def forward_kwargs(model: nn.Module, lengths: Sequence[int], device: torch.device) -> dict[str, Any]:
    """The extra keyword arguments of a packed forward of sequences of ``lengths`` (in row order): the
    segments, and an all-ones ``[1, T]`` mask, which keeps transformers from building its block-diagonal
    ``[T, T]`` one from the restarting positions (SDPA's mask builder returns None for it)."""
    if not installed(model):
        return {}
    segments = Segments.of(lengths)
    return {"varlen": segments, "attention_mask": torch.ones((1, segments.total), dtype=torch.long, device=device)}
