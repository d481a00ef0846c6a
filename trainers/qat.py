"""INT4 quantization-aware training (``train.qat=int4``): the trainer's forward sees the int4 weights.

Every decoder ``nn.Linear`` computes with its weight fake-quantized to the embedded engine's packed int4
format -- symmetric, one scale per group of ``INT4_GROUP`` input elements (``engines/embedded/quant.py``),
the very same rounding -- and the gradient passes straight through the rounding to the full-precision
weight (STE). So the policy the trainer scores is the policy the int4 engine samples from, and the
rollout/train logprob mismatch of int4 rollouts falls to float rounding (``bench/int4_qat.py``).
The weights stay full precision (AdamW steps them); the engine quantizes them again at each sync.

Why not torchao's QAT: its symmetric int4 fake quantizer (``IntxFakeQuantizeConfig(torch.int4,
group_size=32, is_symmetric=True)``, torchao 0.18) puts a group's amax at 7.5 steps (scale amax / 7.5,
codes -8..7, measured), the engine's packed format at 7 steps (scale amax / 7); the trainer must round
exactly like the weights the engine samples with.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from miles_agent.errors import UserError

QAT_CHOICES = ("none", "int4")


def check(qat: str) -> str:
    if qat not in QAT_CHOICES:
        raise UserError(f"train.qat must be one of {', '.join(QAT_CHOICES)}, got {qat!r}")
    return qat


def fake_int4(w: Tensor) -> Tensor:
    """``w`` with the int4 rounding in the forward and the identity in backward (straight-through)."""
    from miles_agent.engines.embedded.quant import int4_fake_quant

    return w + (int4_fake_quant(w.detach()) - w.detach())


class Int4QATLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same names) whose forward uses the int4-rounded weight."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, fake_int4(self.weight), self.bias)


def install(model: nn.Module, qat: str) -> int:
    """Turn the decoder's linear layers into ``Int4QATLinear`` (``qat=int4``); returns how many."""
    if check(qat) == "none":
        return 0
    layers = [m for name, m in model.named_modules() if type(m) is nn.Linear and ".layers." in f".{name}"]
    for m in layers:
        m.__class__ = Int4QATLinear
    return len(layers)
