"""Rank split, micro-batch packing and the next-token grid layout."""

from __future__ import annotations

import torch

from miles_agent.trainers.batching import build_micro_batch, pack_micro_batches, rank_plan, split_across_ranks
from miles_agent.types import Trajectory

LENGTHS = [10, 17, 8, 13, 5, 40]


def test_split_balances_tokens_and_keeps_every_sequence_once() -> None:
    shares = split_across_ranks(LENGTHS, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(LENGTHS)))
    loads = [sum(LENGTHS[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(LENGTHS)
    assert split_across_ranks(LENGTHS, 1) == [[5, 1, 3, 0, 2, 4]]


def test_packing_respects_the_padded_budget_and_never_splits() -> None:
    mbs = pack_micro_batches(range(len(LENGTHS)), LENGTHS, 26)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(LENGTHS)))
    for mb in mbs:
        padded = len(mb) * max(LENGTHS[i] for i in mb)
        assert padded <= 26 or len(mb) == 1  # a sequence over budget rides alone
    assert mbs == [[5], [1], [3, 0], [2, 4]]  # longest first; 2 x 13 = 26 fits


def test_rank_plans_have_equal_length_with_fillers() -> None:
    plans = [rank_plan(LENGTHS, 14, 2, r) for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    assert sorted(i for p in plans for mb in p for i in mb) == list(range(len(LENGTHS)))
    assert any(mb == [] for p in plans for mb in p)


def test_grid_layout_aligns_predictions_with_response_tokens() -> None:
    a = Trajectory(prompt_ids=[1, 2, 3])
    a.append_model([4, 5], [-0.1, -0.2], weight_version=0, turn=0)
    a.append_observation([6], turn=0)
    a.append_model([7], [-0.3], weight_version=0, turn=1, trainable=False)
    b = Trajectory(prompt_ids=[8, 9])
    b.append_model([10], [-0.4], weight_version=0, turn=0)
    mb = build_micro_batch([a, b], [0, 1], [[1.0, 2.0, 3.0, 4.0], [5.0]], pad_id=0)
    # shortest prompt is 2 tokens: grid column 0 is the prediction at input position 1 (of token 2)
    assert mb.offset == 1 and mb.keep == 6
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 0, 0, 0, 0]]
    assert mb.targets.tolist() == [[3, 4, 5, 6, 7], [10, 0, 0, 0, 0]]
    assert mb.response_cols == [(1, 4), (0, 1)]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]  # the untrainable span is 0
    assert mb.sampled.tolist() == [[False, True, True, False, True], [True] + [False] * 4]
    assert mb.advantages[0].tolist() == [0, 1, 2, 3, 4]
    assert mb.rows_to_lists(torch.arange(10.0).view(2, 5)) == [[1.0, 2.0, 0.0, 4.0], [5.0]]
    filler = build_micro_batch([a, b], [], None, pad_id=0)
    assert filler.indices == [] and filler.loss_mask.sum() == 0 and filler.targets.shape == (1, 1)
