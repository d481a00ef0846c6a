"""The ``megatron`` config section, owned by the Megatron trainer (entry point of ``miles_agent.sections``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MegatronConfig:
    """Parallel layout for train.backend=megatron (ranks = tensor * pipeline * context * data)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1  # MoE experts split over this many ranks of each pipeline stage
    expert_tensor_parallel: int = 1
    context_parallel: int = 1
    first_stage_layers: int | None = None  # uneven pipelines: layers on the first / last stage
    last_stage_layers: int | None = None
