"""SFT, then GRPO from the SFT model, then on-policy distillation toward it -- all from the CLI."""

from __future__ import annotations

import json
import math

import pytest

from miles_agent.cli import main

TINY_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(*args: str) -> int:
    return main(["train", "--env", "arith-tools", "--no-progress", *args])


def test_sft_then_grpo_then_distillation(tmp_path, capsys):
    sft, grpo, distill = tmp_path / "sft", tmp_path / "grpo", tmp_path / "distill"

    assert train("--recipe", "tiny-sft", "--run-dir", str(sft), "--steps", "2",
                 "sft.max_examples=8", "sft.batch_size=4") == 0
    rows = records(sft)
    assert [r["step"] for r in rows] == [0, 1] and all(r["sft/examples"] == 8 for r in rows)
    assert all(r["train/loss"] > 0 and r["train/tokens"] > 0 for r in rows)
    assert (sft / "final" / "model.safetensors").is_file()
    assert "done: loss first-5 mean" in capsys.readouterr().out

    assert train("--recipe", "tiny-cpu", "--hf-checkpoint", str(sft / "final"), "--run-dir", str(grpo),
                 "--steps", "1", *TINY_ROLLOUT) == 0
    (row,) = records(grpo)
    assert row["episodes"] == 4 and row["failed"] == 0 and "distill/reverse_kl" not in row
    assert (grpo / "final" / "model.safetensors").is_file()
    assert json.loads((grpo / "config.json").read_text())["model"]["hf_checkpoint"] == str(sft / "final")

    assert train("--recipe", "tiny-distill", "--run-dir", str(distill), "--steps", "1", *TINY_ROLLOUT,
                 f"algo.distill_teacher={sft / 'final'}") == 0
    (row,) = records(distill)
    assert row["episodes"] == 4 and math.isfinite(row["distill/reverse_kl"])
    assert row["distill/teacher_logp"] < 0 and row["distill/student_logp"] < 0
    assert row["train/grad_norm"] > 0  # the KL moved the student although distill_task_coef is 0
    assert (distill / "final" / "model.safetensors").is_file()


def test_bad_inputs_fail_with_one_line_naming_the_fix(tmp_path, capsys):
    assert train("--recipe", "tiny-sft", "--run-dir", str(tmp_path / "a"), f"sft.data={tmp_path / 'x.jsonl'}") == 2
    assert "x.jsonl does not exist; point it at a JSONL file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1]}\n')
    assert train("--recipe", "tiny-sft", "--run-dir", str(tmp_path / "b"), f"sft.data={bad}") == 2
    assert "bad.jsonl line 1: not a trajectory, key 'tokens' is missing" in capsys.readouterr().err
    assert train("--recipe", "tiny-sft", "--run-dir", str(tmp_path / "r"), "--resume") == 2
    assert "--resume is for RL runs" in capsys.readouterr().err
    assert train("--recipe", "tiny-distill", "--run-dir", str(tmp_path / "c"),
                 f"algo.distill_teacher={tmp_path / 'none'}") == 2
    assert "is not an HF model folder (no config.json)" in capsys.readouterr().err
    assert train("--recipe", "tiny-distill", "--run-dir", str(tmp_path / "d"), "algo.distill_teacher=builtin",
                 "algo.distill_mode=forward") == 2
    assert "unknown distillation mode 'forward'" in capsys.readouterr().err
