"""The driver's checkpoint: RNG states round-trip through JSON, and a crash mid-save never moves `latest`."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from miles_agent.errors import UserError
from miles_agent.run_state import capture_rng, latest_checkpoint, restore_rng, write_checkpoint


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(capture_rng()))
    expected = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(state)
    assert _draws() == expected


def test_a_crash_while_saving_leaves_latest_on_the_previous_whole_checkpoint(tmp_path):
    def save_trainer(path):
        path.mkdir()
        (path / "weights").write_text("ok")

    write_checkpoint(tmp_path, 1, save_trainer, {"step": 1})

    def crash(path):
        path.mkdir()
        (path / "weights").write_text("half")
        raise KeyboardInterrupt  # the process dies mid-save

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, 2, crash, {"step": 2})
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_1" and state == {"step": 1} and (path / "trainer" / "weights").read_text() == "ok"
    assert not (tmp_path / "step_2").exists()

    write_checkpoint(tmp_path, 2, save_trainer, {"step": 2})  # the next save clears the leftover
    assert latest_checkpoint(tmp_path)[1] == {"step": 2} and not (tmp_path / "step_2.tmp").exists()


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no checkpoint"):
        latest_checkpoint(tmp_path)
