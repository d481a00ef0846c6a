"""Token logprobs and entropy from the LM head, a chunk of tokens at a time, in fp32.

A full ``[tokens, vocab]`` logits tensor is the largest activation of a long agent trajectory (32k
tokens x 152k vocabulary = 18.6 GiB in fp32, more with its softmax and gradient). ``head_logprobs``
runs the LM head, the fp32 log-softmax and the entropy over ``chunk`` tokens at a time; under
autograd each chunk is checkpointed (``torch.utils.checkpoint``), so backward recomputes one chunk's
logits at a time instead of keeping them all. Only grid cells whose logprob is read are computed
(sampled or trained tokens: pad columns, prompt and observation tokens never reach the head).

``chunked_head(model, fn)`` swaps the HF model's output layer for ``fn`` during one forward call, so
the head still runs inside the model's forward (FSDP2 has the head's weight gathered there, and
``logits_to_keep`` has already cut the hidden states to the grid).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from miles_agent.models.vision import mask_suppressed


def _chunk(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
           entropy: bool, entropy_grad: bool, suppressed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    logits = F.linear(h, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # at least fp32
    logits = mask_suppressed(logits, suppressed)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logp, logp.new_zeros(())
    src, lse_e = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
    ent = lse_e - (torch.softmax(src, -1) * src).sum(-1)
    return logp, ent


class _ChunkedLogp(torch.autograd.Function):
    """Chunked logprobs (and a detached entropy) with a hand-written backward: per chunk it recomputes the
    logits once and forms ``d logp / d logits = onehot - softmax`` directly, so backward neither rebuilds
    the chunk's autograd graph nor recomputes the entropy (what ``checkpoint`` of ``_chunk`` would do)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # noqa: ANN001
                temperature: float, step: int, entropy: bool, suppressed: Tensor | None) -> tuple[Tensor, Tensor]:
        outs = [_chunk(hidden[s:s + step], weight, bias, targets[s:s + step], temperature, entropy, False,
                       suppressed) for s in range(0, max(hidden.shape[0], 1), step)]
        logp = torch.cat([o[0] for o in outs])
        ent = torch.cat([o[1] for o in outs]) if entropy else logp.new_zeros(())
        ctx.save_for_backward(hidden, weight, bias, targets, suppressed)
        ctx.temperature, ctx.step = temperature, step
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_ent: Tensor) -> tuple:  # noqa: ANN001
        hidden, weight, bias, targets, suppressed = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)  # weight / bias gradients summed over chunks
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        for s in range(0, hidden.shape[0], ctx.step):
            h, t, g = hidden[s:s + ctx.step], targets[s:s + ctx.step], grad_logp[s:s + ctx.step, None]
            logits = F.linear(h, weight, bias)
            z = mask_suppressed(logits.to(torch.promote_types(logits.dtype, torch.float32)) / ctx.temperature,
                                suppressed)
            g = g.to(z.dtype)
            dz = torch.softmax(z, -1).mul_(-g).scatter_add_(-1, t[:, None], g).div_(ctx.temperature)
            if suppressed is not None and len(suppressed):
                dz.index_fill_(-1, suppressed, 0.0)  # masked columns: constant logits, no gradient
            d = dz.to(logits.dtype)
            if need_h:
                grad_h[s:s + ctx.step] = d @ weight
            if need_w:
                grad_w.addmm_(d.T.to(acc), h.to(acc))
            if need_b:
                grad_b.add_(d.to(acc).sum(0))
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def head_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                  chunk: int, entropy: bool = False, entropy_grad: bool = False,
                  suppressed: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Logprob of ``targets[i]`` (and the entropy) at ``temperature`` for each row of ``hidden``
    ([N, H] -> [N]); ``chunk`` <= 0 computes all rows at once (the unchunked reference). ``suppressed``
    ids are masked out of the vocabulary (a vision-language policy's image placeholders)."""
    n = hidden.shape[0]
    step = n if chunk <= 0 else chunk
    recompute = torch.is_grad_enabled() and chunk > 0 and (hidden.requires_grad or weight.requires_grad)
    if recompute and not entropy_grad:  # the training forward: a hand-written chunked backward
        logp, ent = _ChunkedLogp.apply(hidden, weight, bias, targets, temperature, step, entropy, suppressed)
        return logp, ent if entropy else None
    logps, ents = [], []
    for start in range(0, max(n, 1), max(step, 1)):
        args = (hidden[start:start + step], weight, bias, targets[start:start + step], temperature, entropy,
                entropy_grad, suppressed)
        logp, ent = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
        logps.append(logp)
        ents.append(ent)
    logp = torch.cat(logps) if len(logps) > 1 else logps[0]
    if not entropy:
        return logp, None
    ent = torch.cat(ents) if len(ents) > 1 else ents[0]
    return logp, ent if entropy_grad else ent.detach()


@contextlib.contextmanager
def chunked_head(model: nn.Module, fn: Callable[[Tensor, Tensor, Tensor | None], Tensor]) -> Iterator[None]:
    """During the block, ``model``'s output layer returns ``fn(hidden, weight, bias)`` instead of logits."""
    head = model.get_output_embeddings()
    head.forward = types.MethodType(lambda self, h: fn(h, self.weight, getattr(self, "bias", None)), head)
    try:
        yield
    finally:
        del head.forward
