"""One request's state inside the embedded engine: tokens so far, stop checks, routing rows, versions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.engines.embedded.sampling import Uniforms, make_generator


@dataclass(eq=False)
class Sequence:
    """A request from enqueue to completion.

    Invariant while it holds a KV-cache slot: the cache covers ``tokens[:cache_len]``; once
    ``prefilled`` (its prompt -- a cached prefix, then chunks -- went through), ``cache_len ==
    len(tokens) - 1`` between steps (the last sampled token is the next decode input).
    """

    rid: int
    prompt: list[int]
    sampling: SamplingParams
    want_routing: bool
    future: asyncio.Future
    stop_ids: frozenset[int]
    max_seq_len: int
    tokenizer: Any = None
    device: torch.device = torch.device("cpu")
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int | None = None
    cache_len: int = 0
    finish: FinishReason | None = None
    error: BaseException | None = None
    cancelled: bool = False
    retractions: int = 0
    matched_stop: int | str | None = None
    versions: list[tuple[int, int]] = field(default_factory=list)  # (weight version, first output index)
    routing: np.ndarray | None = None  # int32 [rows, moe_layers, top_k], rows = tokens that went through
    routing_rows: int = 0
    generator: torch.Generator | None = None
    draws: Uniforms | None = None  # the sampler's uniforms, drawn from ``generator`` in blocks
    prefilled: bool = False
    images: tuple = ()  # the prompt's ImageInputs (a vision-language model)
    vision: Any = None  # their features and M-RoPE positions while the sequence holds a slot (VisionInputs)
    kv_epoch: int = -1  # the engine's weight epoch when this slot's KV began (the prefix cache takes only current KV)

    def __post_init__(self) -> None:
        self.generator = make_generator(self.device, self.sampling.seed)
        self.draws = Uniforms(self.generator)
        self._stop_window = max((len(s.encode()) for s in self.sampling.stop), default=0) + 8

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def check_length(self) -> bool:
        """Finish with LENGTH when no more token may be sampled; True when the sequence is finished."""
        if self.finish is None and (len(self.output) >= self.sampling.max_new_tokens
                                    or len(self.prompt) + len(self.output) >= self.max_seq_len):
            self.finish = FinishReason.LENGTH
        return self.finish is not None

    def append(self, token: int, logprob: float, version: int) -> None:
        """Record a sampled token and decide whether it ends the request (stop before length)."""
        if not self.versions or self.versions[-1][0] != version:
            self.versions.append((version, len(self.output)))
        self.output.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish, self.matched_stop = FinishReason.STOP, token
        elif self.sampling.stop and (hit := self._stop_string_hit()) is not None:
            self.finish, self.matched_stop = FinishReason.STOP, hit
        else:
            self.check_length()

    def _stop_string_hit(self) -> str | None:
        """The stop string the newest token completes, if any.

        Checked after every token, so an earlier occurrence would already have stopped the request;
        only a tail window of tokens (enough bytes for the longest stop string) is decoded.
        """
        tail = self.output[-self._stop_window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        for stop in self.sampling.stop:
            if stop in text and stop not in before:
                return stop
        return None

    def set_routing(self, start: int, rows: np.ndarray) -> None:
        """Write routing rows for token positions ``start:start+len(rows)`` (a re-prefill overwrites)."""
        end = start + len(rows)
        if self.routing is None or self.routing.shape[0] < end:
            cap = max(end, 2 * (0 if self.routing is None else self.routing.shape[0]), 64)
            grown = np.zeros((cap, *rows.shape[1:]), dtype=np.int32)
            if self.routing is not None:
                grown[: self.routing_rows] = self.routing[: self.routing_rows]
            self.routing = grown
        self.routing[start:end] = rows
        self.routing_rows = max(self.routing_rows, end)

    def completion(self, current_version: int) -> Completion:
        assert self.finish is not None
        version = self.versions[-1][0] if self.versions else current_version
        meta: dict[str, Any] = {"rid": self.rid, "weight_versions": list(self.versions),
                                "retractions": self.retractions}
        if self.matched_stop is not None:
            meta["matched_stop"] = self.matched_stop
        routed = None
        if self.want_routing:
            n = len(self.prompt) + len(self.output) - 1
            if self.routing is not None and self.routing_rows >= n:
                routed = self.routing[:n].copy()
            else:  # aborted before its prompt went through the model: there is no routing to report
                meta["routed_experts_missing"] = True
        return Completion(output_ids=list(self.output), output_logprobs=list(self.logprobs),
                          finish_reason=self.finish, weight_version=version, prompt_tokens=len(self.prompt),
                          routed_experts=routed, meta=meta)
