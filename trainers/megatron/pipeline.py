"""Pipeline-parallel micro-batches through Megatron-core's own schedule (1F1B without interleaving).

Every rank of a pipeline holds the same micro-batches (the whole batch reaches every rank); the first
stage embeds them, activations and their gradients travel between stages by point-to-point sends
(NCCL on GPU, gloo on CPU; shapes are exchanged first, since packed micro-batches differ in length),
and the loss runs on the last stage. Our losses are already shares of the step's global loss, so
the schedule's division by the number of micro-batches is undone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_agent.trainers.batching import MicroBatch

LossFn = Callable[[MicroBatch, Tensor], tuple[Tensor, dict[str, Tensor]]]


def run(model: torch.nn.Module, mbs: Sequence[MicroBatch], forward: Callable[[torch.nn.Module, MicroBatch], Tensor],
        loss_func: LossFn, *, forward_only: bool) -> list[dict[str, Tensor]]:
    """Forward (and, unless ``forward_only``, backward) of ``mbs`` through the pipeline; ``loss_func``'s
    metric dicts in micro-batch order on the last stage, [] on the others."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(mbs)

    def forward_step(data: Iterator[MicroBatch], chunk: torch.nn.Module) -> tuple[Tensor, Callable]:
        mb = next(data)

        def loss(output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            value, metrics = loss_func(mb, output)
            return value * n, metrics  # the schedule divides by n

        return forward(chunk, mb), loss

    return list(get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mbs), model=[model], num_microbatches=n,
        seq_length=max(mb.input_ids.shape[1] for mb in mbs), micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
        forward_only=forward_only))


def last_stage_rank() -> int:
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    return dist.get_global_rank(group, dist.get_world_size(group) - 1)


def from_last_stage(tensors: list[Tensor] | None, shapes: Sequence[torch.Size], device: torch.device) -> list[Tensor]:
    """The last stage's float tensors (``shapes``) on every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    out = [t.float().contiguous() for t in tensors] if tensors is not None else \
        [torch.empty(shape, device=device) for shape in shapes]
    for t in out:
        dist.broadcast(t, src=last_stage_rank(), group=ps.get_pipeline_model_parallel_group())
    return out


def object_from_last_stage(obj: Any) -> Any:
    """A picklable value of the last stage, on every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    box = [obj]
    dist.broadcast_object_list(box, src=last_stage_rank(), group=ps.get_pipeline_model_parallel_group())
    return box[0]
