"""Checkpoints are verified on load: a damaged one is passed over for the newest intact one, said; a
damaged HF folder or trainer shard is one line naming the file."""

from __future__ import annotations

import json
import logging
import os

import pytest

from miles_agent.errors import UserError
from miles_agent.run_state import check_checkpoint, latest_checkpoint, write_checkpoint


def _save(root, step):
    def trainer(path):
        path.mkdir()
        (path / "shard.bin").write_bytes(bytes(range(256)) * 40 * step)

    return write_checkpoint(root, step, trainer, {"step": step})


@pytest.fixture
def root(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    return tmp_path


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def test_intact_checkpoints_resume_from_latest(root):
    path, state = latest_checkpoint(root)
    assert path.name == "step_3" and state == {"step": 3} and check_checkpoint(path) is None


@pytest.mark.parametrize("damage, why", [
    (lambda p: _truncate(p / "trainer" / "shard.bin"), "trainer/shard.bin is truncated"),
    (lambda p: _truncate(p / "loop_state.json"), "loop_state.json is truncated or corrupt"),
    (lambda p: (p / "trainer" / "shard.bin").write_bytes(b"\xff" * (p / "trainer" / "shard.bin").stat().st_size),
     "trainer/shard.bin is corrupt"),
    (lambda p: (p / "trainer" / "shard.bin").unlink(), "trainer/shard.bin is missing"),
    (lambda p: _truncate(p / "manifest.json"), "manifest.json is truncated"),
])
def test_a_damaged_latest_falls_back_to_the_previous_intact_step(root, damage, why, caplog):
    damage(root / "step_3")
    with caplog.at_level(logging.WARNING):
        path, state = latest_checkpoint(root)
    assert path.name == "step_2" and state == {"step": 2}
    assert why in caplog.text and "resuming from" in caplog.text and "step_2" in caplog.text


@pytest.mark.parametrize("latest", [b"\xff\xfe\x00", b"", None])
def test_an_unreadable_or_missing_latest_takes_the_newest_whole_step_and_says_so(root, caplog, latest):
    # bytes that are not UTF-8 used to end the resume with a UnicodeDecodeError traceback
    (root / "latest").unlink()
    if latest is not None:
        (root / "latest").write_bytes(latest)
    with caplog.at_level(logging.WARNING):
        path, _ = latest_checkpoint(root)
    assert path.name == "step_3" and "resuming from" in caplog.text
    assert ("names no step" if latest is not None else "latest is missing") in caplog.text


def test_latest_naming_a_missing_step_falls_back_instead_of_blaming_the_version(root, caplog):
    (root / "latest").write_text("step_7")
    with caplog.at_level(logging.WARNING):
        path, _ = latest_checkpoint(root)
    assert path.name == "step_3" and "step_7 is unusable (missing)" in caplog.text
    assert "version" not in caplog.text


def test_a_step_written_after_latest_moved_is_not_preferred_over_it(root):
    (root / "latest").write_text("step_2")  # the crash came between the folder's rename and latest's
    assert latest_checkpoint(root)[0].name == "step_2"


def test_nothing_intact_is_one_clear_error(root):
    for step in (1, 2, 3):
        _truncate(root / f"step_{step}" / "loop_state.json")
    with pytest.raises(UserError, match="no intact checkpoint .*step_3 is unusable.*step_1 is unusable"):
        latest_checkpoint(root)


def test_a_checkpoint_from_before_manifests_still_loads(root):
    (root / "step_3" / "manifest.json").unlink()
    assert latest_checkpoint(root)[0].name == "step_3"


def test_a_truncated_safetensors_file_is_named_not_deserialized(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from miles_agent.models.builder import check_safetensors

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    check_safetensors(path)
    _truncate(path)
    with pytest.raises(UserError, match="model.safetensors is truncated or corrupt"):
        check_safetensors(path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(UserError, match="truncated or corrupt .*header"):
        check_safetensors(path)


def test_a_truncated_trainer_shard_is_one_line(tmp_path):
    pytest.importorskip("torch")
    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.models.builder import build_tiny
    from miles_agent.trainers.fsdp2 import FSDP2Trainer

    model, tok = build_tiny("tiny-qwen3", seed=0)
    trainer = FSDP2Trainer(model, tok, TrainConfig(), AlgoConfig())
    try:
        trainer.save_checkpoint(tmp_path / "ckpt")
        shard = max((tmp_path / "ckpt").glob("*.distcp"), key=lambda p: p.stat().st_size)
        _truncate(shard)
        with pytest.raises(UserError, match=r"trainer checkpoint .*ckpt cannot be read .*truncated or corrupt") as e:
            trainer.load_checkpoint(tmp_path / "ckpt")
        assert "\n" not in str(e.value) and json.loads((tmp_path / "ckpt" / "meta.json").read_text())["step"] == 0
    finally:
        trainer.close()
