"""The one record that flows from an episode to the trainer: a token-in-token-out trajectory.

Invariants (checked by `Trajectory.validate`):

* ``tokens`` = ``prompt_ids`` followed by the response, and the response is a concatenation of
  spans: model spans hold the ids the engine sampled, observation spans the ids the environment
  or the chat template added (tool output, turn markers). Nothing is ever re-tokenized.
* ``loss_mask`` and ``rollout_logprobs`` cover the response only (``len(tokens) - len(prompt_ids)``
  entries). ``loss_mask`` is 1 only inside model spans; it may be 0 inside a model span the
  trainer must not learn from (for example a span cut by an abort). ``rollout_logprobs`` holds the
  engine's logprob for every sampled token and 0.0 for observation tokens.
* ``routed_experts``, when present, is int32 shaped ``(len(tokens) - 1, layers, top_k)``, as SGLang
  returns it: the routing of every token that went through the model (the last sampled token never
  did).
* ``images``: each image the model sees (a screenshot) is stored beside the ids as its PNG bytes, and
  ``tokens[start:end]`` hold its placeholder tokens (one id, what the processor expands the image to),
  never re-tokenized, never sampled (loss mask 0); the PNG's size and digest match what was stored.

The module imports nothing heavier than numpy so that environment workers can use it without torch.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import math
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Status(enum.StrEnum):
    COMPLETED = "completed"  # the episode ended normally and was scored
    TRUNCATED = "truncated"  # a turn/token/length limit ended it; still scored, still trainable
    ABORTED = "aborted"  # infrastructure ended it (engine restart, weight update): retry, never score 0
    FAILED = "failed"  # the episode itself failed (bad task, environment error): not trained on


class SpanKind(enum.StrEnum):
    MODEL = "model"
    OBSERVATION = "observation"


@dataclass
class Span:
    """A run of response tokens ``tokens[start:end]`` with one origin."""

    kind: SpanKind
    start: int
    end: int
    turn: int
    weight_version: int | None = None  # model spans: the engine weight version that sampled them

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "start": self.start, "end": self.end, "turn": self.turn,
                "weight_version": self.weight_version}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Span:
        return cls(SpanKind(d["kind"]), d["start"], d["end"], d["turn"], d.get("weight_version"))


class TrajectoryError(ValueError):
    """A trajectory breaks a TITO invariant; the message names which one."""


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR, None if ``data`` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


@dataclass
class ImageInput:
    """An image input: ``tokens[start:end]`` are its placeholder ids (all ``token_id``), ``data`` its PNG."""

    start: int
    end: int
    token_id: int
    data: bytes = field(repr=False)
    width: int = 0  # 0: read from the PNG
    height: int = 0
    sha256: str = ""  # "" = computed now; a stored digest lets validate() catch a swapped or damaged image

    def __post_init__(self) -> None:
        if not (self.width and self.height):
            self.width, self.height = png_size(self.data) or (0, 0)
        self.sha256 = self.sha256 or hashlib.sha256(self.data).hexdigest()

    def shifted(self, offset: int) -> ImageInput:
        return ImageInput(self.start + offset, self.end + offset, self.token_id, self.data, self.width,
                          self.height, self.sha256)

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "token_id": self.token_id, "width": self.width,
                "height": self.height, "sha256": self.sha256, "png": base64.b64encode(self.data).decode()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageInput:
        return cls(d["start"], d["end"], d["token_id"], base64.b64decode(d["png"]), d["width"], d["height"],
                   d["sha256"])


@dataclass
class Trajectory:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    status: Status = Status.COMPLETED
    task_id: str = ""
    group_id: str = ""  # samples sharing a group_id are normalized together (GRPO)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Trajectories of one rollout (branches of one episode) share it: one sample in group statistics.
    episode_id: str = ""  # "" = this trajectory's own uid
    metadata: dict[str, Any] = field(default_factory=dict)
    images: list[ImageInput] = field(default_factory=list)  # image inputs, in token order (prompt or observations)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if not self.episode_id:
            self.episode_id = self.uid

    # -- building -----------------------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def num_turns(self) -> int:
        return len({s.turn for s in self.spans if s.kind is SpanKind.MODEL})  # a turn may span versions

    def append_model(self, ids: list[int], logprobs: list[float], weight_version: int,
                     turn: int, trainable: bool = True,
                     version_starts: list[tuple[int, int]] | None = None) -> None:
        """Append tokens the engine sampled, with one logprob each.

        ``version_starts`` (the engine's ``(version, first output index)`` list, for a request that
        weights changed under) splits the tokens into one model span per version, so every span names
        the weights that sampled it.
        """
        if len(ids) != len(logprobs):
            raise TrajectoryError(f"{len(ids)} sampled tokens but {len(logprobs)} logprobs")
        start = self.response_length
        self.tokens.extend(ids)
        self.loss_mask.extend([1 if trainable else 0] * len(ids))
        self.rollout_logprobs.extend(float(x) for x in logprobs)
        cuts = [(int(v), int(i)) for v, i in version_starts or () if 0 <= i < len(ids)]
        if len(cuts) < 2:
            self.spans.append(Span(SpanKind.MODEL, start, start + len(ids), turn, weight_version))
            return
        cuts[0] = (cuts[0][0], 0)
        for (version, lo), (_, hi) in zip(cuts, cuts[1:] + [(0, len(ids))]):
            self.spans.append(Span(SpanKind.MODEL, start + lo, start + hi, turn, version))

    @property
    def weight_versions(self) -> list[int]:
        """The weight version of each model span, in order."""
        return [s.weight_version for s in self.spans if s.kind is SpanKind.MODEL and s.weight_version is not None]

    def append_observation(self, ids: list[int], turn: int, images: tuple[ImageInput, ...] | list[ImageInput] = ()) -> None:
        """Append tokens the model did not sample (tool output, template turn markers); ``images`` have
        their placeholder spans relative to ``ids``."""
        self.images.extend(im.shifted(len(self.tokens)) for im in images)
        start = self.response_length
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))
        self.spans.append(Span(SpanKind.OBSERVATION, start, start + len(ids), turn))

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    def _sampled_positions(self) -> list[bool]:
        pos = [False] * self.response_length
        for s in self.spans:
            if s.kind is SpanKind.MODEL:
                pos[s.start:s.end] = [True] * (s.end - s.start)
        return pos

    # -- checking -----------------------------------------------------------------------------
    def validate(self) -> Trajectory:
        """Check every TITO invariant; raise TrajectoryError naming the first one broken."""
        n_prompt, n_resp = len(self.prompt_ids), self.response_length
        if self.tokens[:n_prompt] != self.prompt_ids:
            raise TrajectoryError("tokens do not start with prompt_ids")
        if len(self.loss_mask) != n_resp:
            raise TrajectoryError(f"loss_mask has {len(self.loss_mask)} entries for {n_resp} response tokens")
        if len(self.rollout_logprobs) != n_resp:
            raise TrajectoryError(
                f"rollout_logprobs has {len(self.rollout_logprobs)} entries for {n_resp} response tokens")
        cursor = 0
        for s in self.spans:
            if s.start != cursor or s.end < s.start:
                raise TrajectoryError(f"spans must tile the response in order; span {s} starts at {cursor}")
            cursor = s.end
            if s.kind is SpanKind.MODEL and s.weight_version is None:
                raise TrajectoryError(f"model span {s} has no weight_version")
        if cursor != n_resp:
            raise TrajectoryError(f"spans cover {cursor} of {n_resp} response tokens")
        sampled = self._sampled_positions()
        for i, (m, lp, is_sampled) in enumerate(zip(self.loss_mask, self.rollout_logprobs, sampled)):
            if m not in (0, 1):
                raise TrajectoryError(f"loss_mask[{i}] = {m}, expected 0 or 1")
            if m and not is_sampled:
                raise TrajectoryError(f"loss_mask is 1 at response position {i}, which the model did not sample")
            if is_sampled and not (math.isfinite(lp) and lp <= 1e-6):
                raise TrajectoryError(f"sampled token at response position {i} has logprob {lp}")
            if not is_sampled and lp != 0.0:
                raise TrajectoryError(f"observation token at response position {i} carries logprob {lp}")
        if self.routed_experts is not None:
            re = self.routed_experts
            if re.ndim != 3 or re.shape[0] != len(self.tokens) - 1:
                raise TrajectoryError(
                    f"routed_experts shape {re.shape}, expected ({len(self.tokens) - 1}, layers, top_k)")
        self._validate_images(n_prompt, sampled)
        if self.status in (Status.COMPLETED, Status.TRUNCATED) and self.reward is None:
            raise TrajectoryError(f"a {self.status.value} trajectory must carry a reward")
        return self

    def _validate_images(self, n_prompt: int, sampled: list[bool]) -> None:
        cursor = 0
        for k, im in enumerate(self.images):
            if not cursor <= im.start < im.end <= len(self.tokens):
                raise TrajectoryError(f"image {k}: placeholder span [{im.start}, {im.end}) is out of order or "
                                      f"outside the {len(self.tokens)} tokens")
            cursor = im.end
            if any(t != im.token_id for t in self.tokens[im.start:im.end]):
                raise TrajectoryError(f"image {k}: tokens[{im.start}:{im.end}] are not all its placeholder id {im.token_id}")
            if any(sampled[max(im.start - n_prompt, 0):max(im.end - n_prompt, 0)]):
                raise TrajectoryError(f"image {k}: its placeholder span overlaps tokens the model sampled")
            if png_size(im.data) != (im.width, im.height) or hashlib.sha256(im.data).hexdigest() != im.sha256:
                raise TrajectoryError(f"image {k}: the stored PNG is not the {im.width}x{im.height} image its "
                                      "span was made for (size or sha256 differ)")

    # -- serialization (rollout dumps, Ray transfer) -----------------------------------------------
    def to_dict(self, arrays: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """A JSON-ready dict. With ``arrays``, ``routed_experts`` goes there instead (a binary side file:
        an MoE's routing is layers x top_k ints per token, far too big as JSON), named in the dict."""
        routing: Any = None
        if self.routed_experts is not None:
            if arrays is None:
                routing = self.routed_experts.tolist()
            else:
                routing = {"array": f"routing_{len(arrays)}"}
                arrays[routing["array"]] = self.routed_experts
        return {
            "uid": self.uid, "task_id": self.task_id, "group_id": self.group_id, "episode_id": self.episode_id,
            "prompt_ids": self.prompt_ids, "tokens": self.tokens, "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs, "spans": [s.to_dict() for s in self.spans],
            "routed_experts": routing,
            "reward": self.reward, "reward_parts": self.reward_parts, "status": self.status.value,
            "metadata": self.metadata,
            **({"images": [im.to_dict() for im in self.images]} if self.images else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], arrays: Any = None) -> Trajectory:
        """The inverse of `to_dict`; ``arrays`` is where ``to_dict(arrays)`` put the routing."""
        re = d.get("routed_experts")
        if isinstance(re, dict):
            if arrays is None or re["array"] not in arrays:
                raise ValueError(f"routed_experts is stored in a side file as {re['array']!r}, which was not given")
            re = arrays[re["array"]]
        return cls(
            prompt_ids=list(d["prompt_ids"]), tokens=list(d["tokens"]), loss_mask=list(d["loss_mask"]),
            rollout_logprobs=list(d["rollout_logprobs"]), spans=[Span.from_dict(s) for s in d["spans"]],
            routed_experts=None if re is None else np.asarray(re, dtype=np.int32),
            reward=d.get("reward"), reward_parts=dict(d.get("reward_parts", {})), status=Status(d["status"]),
            task_id=d.get("task_id", ""), group_id=d.get("group_id", ""), uid=d["uid"],
            episode_id=d["episode_id"],
            metadata=dict(d.get("metadata", {})),
            images=[ImageInput.from_dict(im) for im in d.get("images", ())],
        )
