"""Let Megatron-core's layers run on CPU, for tests and debugging only.

Megatron-core assumes CUDA in places that are device moves, not numerics: rotary embeddings move
their frequencies to ``torch.cuda.current_device()``, the tied output layer of the last pipeline stage
is moved with ``.cuda()`` before its first all-reduce, the default causal mask is built on "cuda"
(we always pass an explicit mask), attention dropout forks a CUDA RNG tracker, and the MoE router
references Transformer Engine's GEMM even when TE is absent. ``enable()`` redirects those to the CPU.
With it, the same GPTModel, converted weights and losses run a real forward and backward here, which
is how the HF <-> Megatron conversion and the Megatron trainer are checked without a GPU. The CUDA
path never calls ``enable()``.
"""

from __future__ import annotations

import contextlib

import torch

_enabled = False


def enable() -> None:
    global _enabled
    if _enabled or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # only ever used as a device argument by these layers
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # no CUDA here: a move to it stays put
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _enabled = True
