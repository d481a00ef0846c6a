"""Batched token sampling for the embedded engine, with the logprob convention the trainer relies on.

Convention: the logprob reported for a sampled token is ``log_softmax(logits / T)[token]`` where ``T``
is the request's temperature (``T = 1`` for greedy, ``temperature == 0``), computed *before* top-p /
top-k filtering. The trainer divides its own logits by the same temperature, so the two sides compare
like with like; filtering is a property of the sampler, not of the policy being trained.

Each request owns a ``torch.Generator``, so a seeded request draws the same tokens whichever other
requests share its decode batch. A stochastic row draws by inverse CDF: one uniform per token, where the
exponential race (``argmax p / E``) needed a vocabulary of exponentials -- most of a small model's
sampling time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
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


class Uniforms:
    """One request's U[0, 1) draws for inverse-CDF sampling, taken from its own generator a block at a
    time (one launch per ``block`` steps, not one per step). They depend only on the request's seed,
    never on the batch it shares; on a CPU a block is even the same numbers as one draw per step."""

    block = 64

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._draws: list[float] = []

    def next(self) -> float:
        if not self._draws:
            drawn = torch.rand(self.block, generator=self.generator, device=self.generator.device)
            self._draws = drawn.tolist()[::-1]  # popped from the end: first drawn, first used
        return self._draws.pop()


def _nucleus(scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tokens by descending probability: (order, probabilities in that order, how many are kept).

    Kept is a prefix: a token stays while the mass strictly before it is below top_p (the first always
    stays) and its rank is below top_k."""
    if scaled.device.type == "cpu":  # numpy's SIMD sort: 3x torch's CPU sort (ties may order differently)
        order = torch.from_numpy(np.argsort(-scaled.numpy(), axis=-1))
        sorted_logits = scaled.gather(1, order)
    else:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    if top_k is not None:
        drop |= torch.arange(scaled.shape[-1], device=scaled.device)[None, :] >= top_k[:, None]
    drop[:, 0] = False
    return order, probs, scaled.shape[-1] - drop.sum(dim=-1)


def _inverse_cdf(probs: torch.Tensor, kept: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` with probability ``probs[i] / mass`` among the first ``kept`` of each row (all when None).

    The target ``u * mass`` stays strictly below the mass: u is a float32 (at most 1 - 2^-24) and the
    product's float64 rounding is far finer than that gap. So the first cumulative sum above it is always
    a token with nonzero probability inside the kept prefix."""
    cdf = probs.double().cumsum(dim=-1)
    mass = cdf[:, -1:] if kept is None else cdf.gather(1, (kept - 1)[:, None])
    return torch.searchsorted(cdf, u[:, None] * mass, right=True)[:, 0]


def _uniform(draw: Uniforms | torch.Generator) -> float:
    return draw.next() if isinstance(draw, Uniforms) else float(torch.rand(1, generator=draw, device=draw.device))


def _filtered(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k / top-p drop anything: such a row samples by descending probability."""
    return 0 < p.top_k < vocab or p.top_p < 1


def sample(logits: torch.Tensor, params: list[SamplingParams], draws: list[Uniforms | torch.Generator],
           exact: bool = False, kernels: Any = None) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ([B, V]); return token ids and their logprobs (see module doc).

    Stochastic rows draw by inverse CDF, one uniform each from the request's own `Uniforms` (a bare
    generator is drawn from directly), after top-k / top-p filtering of the tempered distribution.
    ``kernels``: the engine's compiled CPU kernels, which do the same per row in one call (CPU logits only;
    the same draws, so a seeded request stays batch-independent; float rounding may differ from torch's).
    """
    logits = logits.float()
    if kernels is not None and logits.device.type == "cpu" and not exact:
        requests = [(p.temperature, p.top_p, p.top_k, _uniform(d) if p.temperature > 0 else 0.0)
                    for p, d in zip(params, draws)]
        tokens, logprobs = kernels.sample_rows(logits.contiguous(), torch.tensor(requests, dtype=torch.float64))
        return tokens.tolist(), logprobs.tolist()
    vocab = logits.shape[-1]
    dev = logits.device
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=dev)[:, None]
    if exact:
        from miles_agent import true_on_policy

        logp = true_on_policy.log_softmax(scaled)
    else:
        logp = torch.log_softmax(scaled, dim=-1)
    stochastic = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens = logits.argmax(dim=-1) if len(stochastic) < len(params) else None
    if stochastic:
        u = {i: _uniform(draws[i]) for i in stochastic}  # drawn in batch order, one per stochastic row
        if tokens is None:
            tokens = torch.empty(len(params), dtype=torch.long, device=dev)
        # Per row, never per batch, so a seeded request draws the same token in any batch: an unfiltered row
        # walks the vocabulary in token order, a filtered one by descending probability.
        plain = [i for i in stochastic if not _filtered(params[i], vocab)]
        nucleus = [i for i in stochastic if _filtered(params[i], vocab)]
        for group in (plain, nucleus):
            if not group:
                continue
            every = len(group) == len(params)  # the usual batch: no row selection needed
            idx = None if every else torch.tensor(group, device=dev)
            draw = torch.tensor([u[i] for i in group], dtype=torch.float64, device=dev)
            if group is plain:
                picked = _inverse_cdf((logp if every else logp[idx]).exp(), None, draw)
            else:
                rows = [params[i] for i in group]
                top_k = (None if all(p.top_k <= 0 or p.top_k >= vocab for p in rows) else
                         torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in rows], device=dev))
                # top_p = 1 must keep the whole vocabulary, even where fp32 cumsum rounds to 1 early.
                top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in rows], device=dev)
                order, probs, kept = _nucleus(scaled if every else scaled[idx], top_k, top_p)
                picked = order.gather(1, _inverse_cdf(probs, kept, draw)[:, None])[:, 0]
            if every:
                tokens = picked
            else:
                tokens[idx] = picked
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
