"""Let Megatron-core's layers run on CPU, for tests and debugging only.

Megatron-core assumes CUDA in places that are device moves, not numerics: rotary embeddings move
their frequencies to ``torch.cuda.current_device()``, the tied output layer of the last pipeline stage
is moved with ``.cuda()`` before its first all-reduce, the default causal mask is built on "cuda"
(we always pass an explicit mask), attention dropout forks a CUDA RNG tracker, activation recompute
saves the CUDA RNG state, the MoE router
references Transformer Engine's GEMM even when TE is absent, and the pipeline schedules count tokens
in a CUDA tensor and synchronize CUDA after their point-to-point sends. ``enable()`` redirects those to the CPU.
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
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # only ever used as a device argument by these layers
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # no CUDA here: a move to it stays put
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    from megatron.core.tensor_parallel import random as tp_random

    # activation recompute saves and restores the CUDA RNG around each layer: the CPU one stands in
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.synchronize = lambda *args, **kwargs: None  # after pipeline sends: gloo's are synchronous
    schedules.torch = _CpuTorch()  # the pipeline schedules allocate a token counter on "cuda"
    _enabled = True


class _CpuTorch:
    """``torch`` for Megatron's schedules module, with tensors asked for on "cuda" made on the CPU."""

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):  # noqa: ANN001, ANN205
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
