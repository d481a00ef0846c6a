"""Learning-rate schedules are pure functions of the step: warm-up, then constant / cosine / linear."""

from __future__ import annotations

import math

import pytest

from miles_agent.config import TrainConfig
from miles_agent.errors import UserError
from miles_agent.trainers.lr_schedule import lr_at


def test_schedules_by_hand():
    const = TrainConfig(lr=1.0, lr_warmup_steps=4)
    assert [lr_at(const, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TrainConfig(lr=2.0, lr_schedule="cosine", lr_decay_steps=10, min_lr_ratio=0.1)
    assert lr_at(cos, 0) == pytest.approx(2.0)
    assert lr_at(cos, 5) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert lr_at(cos, 10) == pytest.approx(0.2) and lr_at(cos, 50) == pytest.approx(0.2)
    lin = TrainConfig(lr=1.0, lr_schedule="linear", lr_warmup_steps=2, lr_decay_steps=6)
    assert [round(lr_at(lin, s), 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert math.isclose(lr_at(cos, 3), 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.3))))


def test_bad_schedules_are_named():
    with pytest.raises(UserError, match="unknown train.lr_schedule 'steep'"):
        lr_at(TrainConfig(lr_schedule="steep"), 0)
    with pytest.raises(UserError, match="needs train.lr_decay_steps"):
        lr_at(TrainConfig(lr_schedule="cosine"), 5)
