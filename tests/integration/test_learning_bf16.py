"""The built-in task learns with model.dtype=bfloat16 (bf16 compute over fp32 master weights) as it does
in fp32: the same recipe, seed and steps; the fast check is tests/trainers/test_precision.py."""

from __future__ import annotations

import time
from statistics import mean

import pytest

from miles_agent.config import load_config
from miles_agent.loop import train


def rewards(tmp_path, dtype: str) -> list[float]:  # noqa: ANN001
    cfg = load_config("tiny-cpu", {"run.steps": 12, "run.run_dir": str(tmp_path / dtype), "run.progress": False,
                                   "model.dtype": dtype})
    t0 = time.perf_counter()
    records = train(cfg)
    print(dtype, f"{time.perf_counter() - t0:.0f}s", [round(r["reward_mean"], 3) for r in records])
    assert all(r["failed"] == 0 and r["train/grad_norm"] > 0 for r in records)
    return [r["reward_mean"] for r in records]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_reward_rises_in_bf16_like_fp32(tmp_path):
    bf16, fp32 = rewards(tmp_path, "bfloat16"), rewards(tmp_path, "float32")
    gain_bf16, gain_fp32 = mean(bf16[-3:]) - mean(bf16[:3]), mean(fp32[-3:]) - mean(fp32[:3])
    assert gain_bf16 >= 0.2, bf16
    assert gain_bf16 >= 0.5 * gain_fp32, (bf16, fp32)
