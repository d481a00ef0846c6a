"""Batched token sampling for the embedded engine, with the logprob convention the trainer relies on.

Convention: the logprob reported for a sampled token is ``log_softmax(logits / T)[token]`` where ``T``
is the request's temperature (``T = 1`` for greedy, ``temperature == 0``), computed *before* top-p /
top-k filtering. The trainer divides its own logits by the same temperature, so the two sides compare
like with like; filtering is a property of the sampler, not of the policy being trained.

Each request owns a ``torch.Generator``, so a seeded request draws the same tokens whichever other
requests share its decode batch.
"""

from __future__ import annotations

import torch

from miles_agent.engine import SamplingParams


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A per-request generator; unseeded requests draw their seed from torch's global RNG.

    Drawing from the global RNG keeps runs reproducible under ``torch.manual_seed`` while each
    request still gets its own stream, independent of batching.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def _filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus; returns sorted logits + order."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = ranks[None, :] >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass strictly before it is below top_p (the first token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf")), order


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           exact: bool = False) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ([B, V]); return token ids and their logprobs (see module doc).

    Stochastic rows use the exponential race (``argmax p / E`` with ``E ~ Exp(1)``, an exact sample
    from ``p``): only the noise is drawn row by row, from each request's own generator.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    dev = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
    scaled = logits / temps[:, None]
    if exact:
        from miles_agent import true_on_policy

        logp = true_on_policy.log_softmax(scaled)
    else:
        logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    stochastic = [i for i, p in enumerate(params) if p.temperature > 0]
    if stochastic:
        idx = torch.tensor(stochastic, device=dev)
        rows = [params[i] for i in stochastic]
        if all(p.top_k < 0 and p.top_p >= 1 for p in rows):
            probs, order = logp[idx].exp(), None
        else:
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in rows], device=dev)
            # top_p = 1 must keep the whole vocabulary, even where fp32 cumsum rounds to 1 early.
            top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in rows], device=dev)
            filtered, order = _filter_logits(scaled[idx], top_k, top_p)
            probs = filtered.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(stochastic):
            noise[row].exponential_(generator=generators[i])
        pick = (probs / noise).argmax(dim=-1)
        tokens[idx] = pick if order is None else order.gather(1, pick[:, None])[:, 0]
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
