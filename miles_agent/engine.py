"""The rollout-engine contract, shaped like SGLang's ``/generate`` so that an SGLang backend is a thin client.

A harness only sees `Policy` (one async ``generate``). The driver also sees `RolloutEngine`: pause and
resume around weight updates, weight loading, health. Backends are plug-ins (``engines/``, entry-point
group ``miles_agent.engines``): ``embedded`` (the in-process torch engine) and ``sglang`` (HTTP client of
SGLang servers).

Torch-free on purpose: environment workers import this module.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or stop string was sampled (it is kept in output_ids)
    LENGTH = "length"  # max_new_tokens or the context limit was reached
    ABORT = "abort"  # the request was aborted (pause in abort mode, engine shutdown)


class PauseMode(enum.StrEnum):
    """What happens to in-flight requests on pause (SGLang's ``/pause_generation`` modes)."""

    ABORT = "abort"  # finish them now with FinishReason.ABORT and what they sampled so far
    RETRACT = "retract"  # drop their KV cache; they continue (re-prefilled) after resume
    IN_PLACE = "in_place"  # freeze them with their KV cache; they continue after resume


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's ``sampling_params`` subset every backend honours. ``top_k=-1`` means no top-k."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    lora_path: str | None = None  # the LoRA adapter serving this request (SGLang's top-level lora_path)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")

    def to_sglang(self) -> dict[str, Any]:
        d: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                             "top_p": self.top_p, "top_k": self.top_k}
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            d["stop"] = list(self.stop)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass
class Completion:
    """What one ``generate`` returns: SGLang's ``output_ids`` plus ``meta_info``."""

    output_ids: list[int]
    output_logprobs: list[float]  # logprob of each sampled token under the sampling distribution's model
    finish_reason: FinishReason
    weight_version: int
    prompt_tokens: int = 0
    # int32 (prompt_tokens + len(output_ids) - 1, layers, top_k) when return_routed_experts was asked.
    routed_experts: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scores:
    """What ``score`` returns: the logprob of each input token from ``logprob_start_len`` on.

    ``input_token_logprobs[i]`` is ``log_softmax(logits / temperature)`` of ``input_ids[logprob_start_len + i]``
    given every token before it -- SGLang's ``meta_info.input_token_logprobs`` of a ``max_new_tokens=0``
    request, without its leading entry (SGLang's first entry in the window has no logprob of its own).
    """

    input_token_logprobs: list[float]
    logprob_start_len: int
    weight_version: int


def check_score_request(input_ids: list[int], logprob_start_len: int, temperature: float) -> None:
    if not 1 <= logprob_start_len <= len(input_ids):
        raise ValueError(f"logprob_start_len must be in [1, len(input_ids)={len(input_ids)}] (the first token "
                         f"has nothing to condition on), got {logprob_start_len}")
    if not temperature > 0:
        raise ValueError(f"scoring temperature must be > 0, got {temperature}")


@runtime_checkable
class Policy(Protocol):
    """What a harness calls. It never learns which engine stands behind it.

    A vision-language policy's request also passes ``images=`` (the prompt's `ImageInput`s, each over its
    run of placeholder ids); a harness passes it only when there are images, so text-only engines need not
    take it."""

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion: ...


@runtime_checkable
class Scorer(Protocol):
    """Teacher-forced logprobs of given tokens (no sampling): what on-policy distillation asks a teacher
    engine, and what a student engine answers for the other side of the KL. Engines implement it next
    to `RolloutEngine`; over HTTP it would be one SGLang ``/generate`` with ``max_new_tokens=0``."""

    async def score(self, input_ids: list[int], *, logprob_start_len: int = 1,
                    temperature: float = 1.0) -> Scores: ...


@runtime_checkable
class RolloutEngine(Policy, Protocol):
    """A policy the driver can also pause, reload and check."""

    @property
    def weight_version(self) -> int: ...

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load weights by engine-side name and set the weight version.

        A transport calls this once per bucket, all with the same version, while the engine is paused.
        """
        ...

    async def health(self) -> bool: ...

    async def shutdown(self) -> None: ...
