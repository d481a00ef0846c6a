"""Metric sinks: JSONL always; TensorBoard and W&B (offline) get the same numbers, read back from disk."""

from __future__ import annotations

import json
import math
import time

import pytest

from miles_agent.errors import UserError
from miles_agent.sinks import build_sinks, parse_sinks

RECORDS = [
    {"step": 0, "reward_mean": 0.25, "train/loss": -0.5, "time/rollout": 1.5, "staleness/hist/0": 16.0,
     "note": "text is JSONL-only", "flag": True},
    {"step": 1, "reward_mean": 0.75, "train/loss": float("nan"), "time/rollout": 2.0},
    {"step": 2, "reward_mean": 1.0, "train/loss": 0.125, "time/rollout": 0.5},
]


def test_parse_sinks_names_the_valid_choices():
    assert parse_sinks("") == []
    assert parse_sinks("jsonl, TensorBoard ,wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(UserError, match="unknown sink 'mlflow'.*tensorboard, wandb"):
        parse_sinks("tensorboard,mlflow")


def test_jsonl_keeps_every_field_in_order(tmp_path):
    sinks = build_sinks(tmp_path, "")
    for r in RECORDS:
        sinks.write(r)
    sinks.close()
    back = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in back] == [0, 1, 2]
    assert back[0]["note"] == "text is JSONL-only" and math.isnan(back[1]["train/loss"])


def test_tensorboard_event_file_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(tmp_path, "tensorboard")
    for r in RECORDS:
        sinks.write(r)
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "train/loss", "time/rollout", "staleness/hist/0"} <= tags
    assert not tags & {"note", "flag", "step"}  # text, booleans and the step itself are not scalars
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(0, 0.25), (1, 0.75), (2, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(0, -0.5), (2, 0.125)]  # NaN skipped


def test_wandb_offline_run_directory_holds_the_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb_reader import history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = build_sinks(tmp_path, "wandb", {"run": {"steps": 3}}, wandb_project="obs-test")
    for r in RECORDS:
        sinks.write(r)
    sinks.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    run_dirs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(run_dirs) == 1, list((tmp_path / "wandb").iterdir())
    # finish() returns once W&B's service process has the records; on a loaded machine the .wandb file
    # can still be a few writes behind, so give the service a bounded moment to flush.
    deadline = time.monotonic() + 60
    while True:
        rows = history(run_dirs[0] / f"run-{run_id}.wandb")
        if len(rows) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [r["_step"] for r in rows] == [0, 1, 2]
    assert [r["reward_mean"] for r in rows] == [0.25, 0.75, 1.0]
    assert rows[2]["train/loss"] == 0.125 and rows[0]["staleness/hist/0"] == 16.0
    assert "note" not in rows[0] and "flag" not in rows[0]
