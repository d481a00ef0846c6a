"""bench/gpu_check.py runs end to end on CPU (--quick, its dry run), so the script a GPU session runs is known
to work: every section, the HF generate baseline and the weight sync included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~55 s: the nightly command keeps the script a GPU session runs from rotting
def test_gpu_check_quick_on_cpu():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["engine"]["generated_tokens"] > 0 and report["hf_generate"]["generated_tokens"] > 0
    assert report["engine"]["vs_hf_generate"] > 0
    assert report["fsdp2"]["step_time_s_median"] > 0
    assert report["megatron"]["logprob_max_abs_diff_vs_fsdp2"] < 1e-4
    assert report["megatron"]["loss_rel_diff_vs_fsdp2"] < 1e-3
    offload = report["offload"]  # colocation: state released, and training after the round trip unchanged
    assert offload["trainer_state_gib"] > 0 and offload["resident_bytes_offloaded"] == 0
    assert offload["losses_match"] and offload["weights_max_abs_diff_vs_no_offload"] == 0
    sync = report["sync"]  # the weight-sync code path: shared memory and gloo stand in for CUDA IPC and NCCL
    assert sync["bytes"] > 0 and sync["shm"]["gbps"] > 0 and sync["shm"]["raw_device_copy_gbps"] > 0
    assert sync["gloo"]["gbps"] > 0 and sync["gloo"]["raw_broadcast_gbps"] > 0
