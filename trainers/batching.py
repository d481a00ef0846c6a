"""Splitting a train batch across ranks and into padded micro-batches, and laying it out as tensors.

Every rank receives the whole batch and computes the *same* plan locally (no communication): the
sequences are balanced over ranks by token count, then bin-packed into micro-batches of at most
``micro_batch_tokens`` padded tokens (real tokens when the trainer packs them, ``pack``). FSDP runs collectives in every forward and backward, so all
ranks must run the same number of micro-batches: ranks with fewer get empty "filler" micro-batches
(one pad row, nothing trains) to keep them in lockstep.

Tensors live on a grid of next-token positions: column ``c`` of a micro-batch holds the prediction
made at input position ``offset + c`` for the token at ``offset + c + 1``. ``offset`` is the
shortest prompt minus one, so the LM head never runs on positions that only predict prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_agent.types import SpanKind, Trajectory


def split_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices per rank, longest first to the least-loaded rank (ties: lowest rank); deterministic."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def pack_micro_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int,
                       packed: bool = False) -> list[list[int]]:
    """Greedy packing of length-sorted sequences: a micro-batch grows while its size stays within
    ``max_tokens`` -- ``rows * longest`` padded, the sum of its lengths when ``packed`` (varlen: no pad is
    computed). Sorting keeps padding small (and equal lengths adjacent, which varlen attention batches);
    no sequence is split, so a sequence longer than ``max_tokens`` gets a micro-batch of its own."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    size = 0
    for i in order:
        if out:
            grown = size + lengths[i] if packed else (len(out[-1]) + 1) * lengths[out[-1][0]]
            if grown <= max_tokens:
                out[-1].append(i)
                size = grown
                continue
        out.append([i])
        size = lengths[i]
    return out


def rank_plan(lengths: Sequence[int], max_tokens: int, world_size: int, rank: int,
              packed: bool = False) -> list[list[int]]:
    """This rank's micro-batches (lists of batch indices), padded with ``[]`` fillers to the longest plan."""
    plans = [pack_micro_batches(share, lengths, max_tokens, packed)
             for share in split_across_ranks(lengths, world_size)]
    longest = max((len(p) for p in plans), default=0)
    return plans[rank] + [[] for _ in range(longest - len(plans[rank]))]


@dataclass
class MicroBatch:
    """One padded micro-batch on the next-token grid (see the module docstring)."""

    indices: list[int]  # batch indices of the rows; [] for a filler
    input_ids: Tensor  # [B, L] right-padded
    attention_mask: Tensor  # [B, L]
    offset: int  # grid column 0 predicts input position offset + 1
    targets: Tensor  # [B, K] the token each grid column predicts
    loss_mask: Tensor  # [B, K] float, 1 where a token trains
    sampled: Tensor  # [B, K] bool, response positions the model sampled
    advantages: Tensor  # [B, K]
    rollout_logp: Tensor  # [B, K]
    response_cols: list[tuple[int, int]]  # per row: (first grid column of the response, response length)
    routed_experts: Tensor | None = None  # [B, L, moe_layers, top_k] replay ids (R3), -1 = not replayed
    teacher_logp: Tensor | None = None  # [B, K] when the batch carries a teacher's logprobs (distillation)
    # Packed forward (``pack``): the rows' real tokens in one row, positions restarting per sequence,
    # and for each grid cell the packed position whose hidden state predicts it (where ``real``).
    packed_ids: Tensor | None = None  # [1, T]
    packed_positions: Tensor | None = None  # [1, T]
    packed_src: Tensor | None = None  # [B, K] long
    packed_lengths: list[int] | None = None  # the rows' lengths in the packed row, in row order
    # A vision-language model's image inputs of the rows, in row then token order (``add_images``).
    pixel_values: Tensor | None = None  # [patches, C * T * P * P]
    image_grid_thw: Tensor | None = None  # [images, 3]
    mm_token_type_ids: Tensor | None = None  # [B, L] 1 at image placeholder ids

    def model_inputs(self) -> dict[str, Tensor]:
        """The image keyword arguments of the HF forward ({} for a text-only micro-batch)."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "mm_token_type_ids": self.mm_token_type_ids}

    @property
    def real(self) -> Tensor:
        """[B, K] bool: grid cells whose target is a real token of the row (not padding)."""
        return self.attention_mask[:, self.offset + 1:].bool()

    @property
    def scored(self) -> Tensor:
        """[B, K] bool: the cells whose logprob anything reads -- sampled or trained tokens (every loss
        term, metric and ``rows_to_lists`` masks the others out). The LM head runs on these only."""
        return self.real & (self.sampled | (self.loss_mask > 0))

    @property
    def keep(self) -> int:
        """How many trailing input positions need logits (``logits_to_keep``)."""
        return self.input_ids.shape[1] - self.offset

    def to(self, device: torch.device | str) -> MicroBatch:
        for name in ("input_ids", "attention_mask", "targets", "loss_mask", "sampled", "advantages",
                     "rollout_logp", "teacher_logp", "routed_experts", "packed_ids", "packed_positions",
                     "packed_src", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self

    def rows_to_lists(self, grid: Tensor) -> list[list[float]]:
        """Per row, the response-aligned values of a ``[B, K]`` grid tensor (0.0 where not sampled)."""
        vals = torch.where(self.sampled, grid.detach().float(), torch.zeros((), device=grid.device)).cpu()
        return [vals[b, c:c + n].tolist() for b, (c, n) in enumerate(self.response_cols)]


def build_micro_batch(trajectories: Sequence[Trajectory], indices: list[int],
                      advantages: Sequence[Sequence[float]] | None, pad_id: int,
                      teacher_logprobs: Sequence[Sequence[float]] | None = None) -> MicroBatch:
    """Lay out ``trajectories[indices]`` on the grid; ``indices == []`` builds a filler row."""
    rows = [trajectories[i] for i in indices]
    if not rows:  # a filler: two pad tokens, nothing trains, every parameter still sees a forward
        filler = Trajectory(prompt_ids=[pad_id])
        filler.append_observation([pad_id], turn=0)
        rows, advs = [filler], [[0.0]]
    else:
        advs = [advantages[i] for i in indices] if advantages is not None else [[0.0] * t.response_length
                                                                                for t in rows]
    for t in rows:
        if not t.prompt_ids and t.response_length:
            raise ValueError(f"trajectory {t.uid} has an empty prompt: its first token has no prediction")
    seq_len = max(len(t.tokens) for t in rows)
    offset = max(min(min(len(t.prompt_ids) for t in rows) - 1, seq_len - 2), 0)
    width = seq_len - offset - 1
    shape = (len(rows), width)
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), seq_len), dtype=torch.long)
    grid = {k: torch.zeros(shape) for k in ("loss_mask", "advantages", "rollout_logp")}
    sampled = torch.zeros(shape, dtype=torch.bool)
    cols = []
    for b, (t, adv) in enumerate(zip(rows, advs)):
        input_ids[b, :len(t.tokens)] = torch.tensor(t.tokens, dtype=torch.long)
        attention[b, :len(t.tokens)] = 1
        c, n = len(t.prompt_ids) - 1 - offset, t.response_length
        cols.append((c, n))
        grid["loss_mask"][b, c:c + n] = torch.tensor(t.loss_mask, dtype=torch.float)
        grid["advantages"][b, c:c + n] = torch.tensor(adv, dtype=torch.float)
        grid["rollout_logp"][b, c:c + n] = torch.tensor(t.rollout_logprobs, dtype=torch.float)
        for span in t.spans:
            if span.kind is SpanKind.MODEL:
                sampled[b, c + span.start:c + span.end] = True
    targets = input_ids[:, offset + 1:].clone()
    teacher = None
    if teacher_logprobs is not None:  # a filler row gets zeros: its mask is empty
        teacher = torch.zeros(shape)
        for b, i in enumerate(indices):
            c, n = cols[b]
            teacher[b, c:c + n] = torch.tensor(teacher_logprobs[i], dtype=torch.float)
    return MicroBatch(list(indices), input_ids, attention, offset, targets, sampled=sampled,
                      response_cols=cols, teacher_logp=teacher, **grid)


def add_images(mb: MicroBatch, trajectories: Sequence[Trajectory], image_token_id: int) -> MicroBatch:
    """Attach the rows' images (`Trajectory.images`) as the processor's pixel values and grids; their
    placeholder ids stay as the trajectory holds them (never re-tokenized)."""
    from miles_agent.models.vision import pixel_inputs

    pngs = [im.data for i in mb.indices for im in trajectories[i].images]
    if pngs:
        mb.pixel_values, mb.image_grid_thw = pixel_inputs(pngs)
        mb.mm_token_type_ids = (mb.input_ids == image_token_id).int()
    return mb


def pack(mb: MicroBatch) -> MicroBatch:
    """Add the packed layout to ``mb`` (varlen packing): its rows' real tokens concatenated into one row
    with ``position_ids`` restarting at each sequence; attention never crosses a sequence boundary
    (``varlen``: causal SDPA per sequence; else transformers' block-diagonal mask, or cu_seqlens with
    flash attention). The grid stays padded: only the forward runs packed, the loss reads the same
    ``[B, K]`` grid (small: one value per cell, against the forward's hidden size per token)."""
    lengths = [int(n) for n in mb.attention_mask.sum(-1).tolist()]
    device = mb.input_ids.device
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long, device=device).cumsum(0)
    mb.packed_ids = mb.input_ids[mb.attention_mask.bool()][None]  # right padding: row by row, real tokens only
    mb.packed_positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    mb.packed_lengths = lengths
    cols = torch.arange(mb.targets.shape[1], device=device)
    mb.packed_src = (starts[:, None] + mb.offset + cols[None]).where(mb.real, torch.zeros((), dtype=torch.long))
    return mb
