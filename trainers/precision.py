"""Mixed precision: fp32 master weights and optimizer state, compute in the model's dtype.

A model loaded with ``model.dtype: bfloat16`` is trained the way the field does it: the optimizer keeps
``train.master_dtype`` (fp32) parameters and Adam moments, the forward and backward run in bf16, and
gradients are reduced in fp32. Why not plain bf16 AdamW: bf16 has 8 significand bits, so an update
smaller than ~2^-9 of a weight rounds away -- at lr 1e-6 on weights of std 0.02 almost none change.

- FSDP2: the sharded parameters are the fp32 masters; ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` casts them to bf16 as they are all-gathered, and the bf16 gradients to fp32
  for the reduce-scatter. One code path for one process (a single-rank gloo group) and N ranks.
- Megatron: bf16 model parameters with an fp32 main copy per parameter (``MainParams``, what
  Megatron's ``Float16OptimizerWithFloat16Params`` does): gradients are accumulated into the main
  copy in fp32 as backward produces them, clipped and stepped there, then copied back into the model.

Weights leave the trainer (``named_weights``, ``save_hf``) in the compute dtype, i.e. the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from miles_agent.config import TrainConfig
from miles_agent.errors import UserError

FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtypes(model: nn.Module, train: TrainConfig) -> tuple[torch.dtype, torch.dtype]:
    """(compute, master): the dtype the model arrived in and the one its optimizer keeps."""
    compute = next(model.parameters()).dtype
    if train.master_dtype not in FLOATS:
        raise UserError(f"train.master_dtype={train.master_dtype!r} is not a float dtype; use float32 "
                        "(fp32 master weights) or bfloat16 (plain bf16 training)")
    master = FLOATS[train.master_dtype]
    if compute == torch.float16:
        raise UserError("model.dtype=float16 would train without loss scaling (gradients underflow); use "
                        "model.dtype=bfloat16, which has float32's range")
    if master.itemsize < compute.itemsize:
        raise UserError(f"train.master_dtype={train.master_dtype} is narrower than the model's {compute}; "
                        "set train.master_dtype=float32")
    return compute, master


def fsdp_policy(compute: torch.dtype, master: torch.dtype):  # noqa: ANN201
    """FSDP2's mixed-precision policy, or None when compute and master agree."""
    if compute == master:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


class MainParams:
    """fp32 main copies of a module's low-precision parameters (Megatron's mixed-precision optimizer
    without its CUDA-only buffers). The optimizer steps ``params()``; a gradient hook folds each model
    gradient into its main copy in fp32 as backward produces it (so micro-batches accumulate in fp32)."""

    def __init__(self, module: nn.Module, master: torch.dtype = torch.float32) -> None:
        self.pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            main = nn.Parameter(p.detach().to(master).clone())
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                         "sequence_parallel", "average_gradients_across_tp_domain", "allreduce"):
                if hasattr(p, attr):
                    setattr(main, attr, getattr(p, attr))
            p.main_copy = main  # where code that finds a model parameter looks for its gradient
            p.register_post_accumulate_grad_hook(self._accumulate(main))
            self.pairs.append((name, p, main))

    @staticmethod
    def _accumulate(main: nn.Parameter):  # noqa: ANN205
        def hook(p: Tensor) -> None:
            g = p.grad.to(main.dtype)
            main.grad = g if main.grad is None else main.grad.add_(g)
            p.grad = None  # the low-precision gradient is not kept: its fp32 sum lives on the main copy

        return hook

    def params(self) -> list[nn.Parameter]:
        return [main for _, _, main in self.pairs]

    def named(self) -> Iterable[tuple[str, nn.Parameter, nn.Parameter]]:
        """(name, model parameter, main parameter) -- the gradient lives on the main parameter."""
        return self.pairs

    @torch.no_grad()
    def to_model(self) -> None:
        """The stepped main weights, rounded into the model's parameters."""
        for _, p, main in self.pairs:
            p.copy_(main)

    def state_dict(self) -> dict[str, Tensor]:
        return {name: main.detach() for name, _, main in self.pairs}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for name, _, main in self.pairs:
            main.copy_(state[name])
        self.to_model()
