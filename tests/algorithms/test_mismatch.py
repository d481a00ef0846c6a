"""Rollout/training mismatch metrics and corrections (TIS, MIS, icepop, veto) against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from miles_agent.algorithms.mismatch import check_options, correction_weights, mismatch_sums
from miles_agent.config import AlgoConfig
from miles_agent.errors import UserError

# w = pi_train / pi_rollout: row 0 = (2, 0.25, masked 9), row 1 = (1.5, 0.9, masked)
W = torch.tensor([[2.0, 0.25, 9.0], [1.5, 0.9, 1.0]])
ROLLOUT = torch.full((2, 3), -2.0)
TRAIN = ROLLOUT + W.log()
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def weights(**kw: object) -> list[list[float]]:
    return correction_weights(TRAIN, ROLLOUT, MASK, **kw).tolist()


def close(got: list[list[float]], want: list[list[float]]) -> None:
    assert [v for r in got for v in r] == pytest.approx([v for r in want for v in r], abs=1e-6)


def test_tis_truncates_at_high() -> None:
    close(weights(correction="tis", level="token", high=1.8), [[1.8, 0.25, 0.0], [1.5, 0.9, 0.0]])
    # sequence: products 0.5 and 1.35; geometric: their square roots
    close(weights(correction="tis", level="sequence", high=2.0), [[0.5, 0.5, 0.0], [1.35, 1.35, 0.0]])
    close(weights(correction="tis", level="sequence", high=1.2), [[0.5, 0.5, 0.0], [1.2, 1.2, 0.0]])
    g0, g1 = math.sqrt(0.5), math.sqrt(1.35)
    close(weights(correction="tis", level="geometric", high=2.0), [[g0, g0, 0.0], [g1, g1, 0.0]])


def test_mis_masks_outside_the_range() -> None:
    close(weights(correction="mis", level="token", low=0.5, high=2.0), [[2.0, 0.0, 0.0], [1.5, 0.9, 0.0]])
    close(weights(correction="mis", level="sequence", low=0.8, high=1.25), [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(weights(correction="mis", level="sequence", low=0.5, high=2.0), [[0.5, 0.5, 0.0], [1.35, 1.35, 0.0]])
    g0, g1 = math.sqrt(0.5), math.sqrt(1.35)
    close(weights(correction="mis", level="geometric", low=0.75, high=2.0), [[0.0, 0.0, 0.0], [g1, g1, 0.0]])
    assert g0 < 0.75


def test_icepop_is_token_level_whatever_the_level_and_veto_drops_sequences() -> None:
    close(weights(correction="icepop", level="sequence", low=0.5, high=1.6), [[0.0, 0.0, 0.0], [1.5, 0.9, 0.0]])
    # a token with w = 0.25 < veto 0.3 drops its whole sequence
    close(weights(correction="tis", level="token", high=2.0, veto=0.3), [[0.0, 0.0, 0.0], [1.5, 0.9, 0.0]])
    close(weights(correction="none"), [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_mismatch_sums_by_hand() -> None:
    s = {k: float(v) for k, v in mismatch_sums(TRAIN, ROLLOUT, MASK, low=0.5, high=2.0).items()}
    logs = [math.log(2), math.log(0.25), math.log(1.5), math.log(0.9)]
    assert s["tokens"] == 4
    assert s["abs_sum"] == pytest.approx(sum(abs(x) for x in logs), abs=1e-5)
    assert s["abs_max"] == pytest.approx(math.log(4), abs=1e-5)
    assert s["k1_sum"] == pytest.approx(-sum(logs), abs=1e-5)
    assert s["k3_sum"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs), abs=1e-5)
    assert s["out_of_range"] == 1  # only 0.25; 2.0 is inside the closed range


def test_options_are_checked_with_the_fix() -> None:
    with pytest.raises(UserError, match="tis, mis, icepop"):
        check_options(AlgoConfig(mismatch_correction="is"))
    with pytest.raises(UserError, match="use_rollout_logprobs=false"):
        check_options(AlgoConfig(mismatch_correction="tis"))
    with pytest.raises(UserError, match="geometric"):
        check_options(AlgoConfig(mismatch_level="seq", use_rollout_logprobs=False))
    with pytest.raises(UserError, match="low <= 1 <= high"):
        check_options(AlgoConfig(mismatch_low=1.5))
    check_options(AlgoConfig(mismatch_correction="mis", mismatch_level="geometric", use_rollout_logprobs=False))
