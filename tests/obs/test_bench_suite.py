"""The benchmark suite runs end to end in --quick mode and writes every ratio with machine info."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", ROOT / "bench" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_external_bench_ratios_are_read_from_its_output(tmp_path, monkeypatch):
    run_all = _run_all()
    monkeypatch.setattr(run_all, "BENCH_DIR", tmp_path)
    (tmp_path / "weight_sync.py").write_text(
        "import sys\nquick = '--quick' in sys.argv\n"
        "print('bucketed push: 812.0 MB/s')\n"
        "print('ratio push / raw copy:', '0.50x' if quick else '0.75x')\n"
        "print('ratio push / broadcast: 1.25x')\n")
    out = run_all.external("weight_sync")(True, 2)
    assert out["ratios"] == {"ratio push / raw copy": [0.5, 0.5], "ratio push / broadcast": [1.25, 1.25]}
    assert run_all.external("async_vs_sync")(True, 1)["status"] == "not available"
    (tmp_path / "async_vs_sync.py").write_text("raise SystemExit('boom')\n")
    with pytest.raises(RuntimeError, match="exited 1: boom"):
        run_all.external("async_vs_sync")(True, 1)
    assert run_all.summarize([3.0, 1.0, float("nan"), 2.0])["median"] == 2.0


def test_quick_suite_reports_every_ratio(tmp_path):
    pytest.importorskip("trl")
    import subprocess

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run_all.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True and report["machine"]["cpus"] >= 1 and "loadavg_end" in report["machine"]
    results = report["results"]
    assert set(results) == {"engine_vs_hf", "trainer_vs_trl", "sandbox_overhead", "weight_sync", "async_vs_sync",
                            "e2e_vs_trl"}
    for name in ("engine_vs_hf", "trainer_vs_trl", "sandbox_overhead", "e2e_vs_trl"):
        assert results[name]["status"] == "ok", results[name]
        assert results[name]["ratios"], name
        for label, s in results[name]["ratios"].items():
            assert s["min"] <= s["median"] <= s["max"] and math.isfinite(s["median"]) and s["median"] > 0, label
            assert label in proc.stdout  # printed too
    for name in ("weight_sync", "async_vs_sync"):  # another helper's script, present or not
        assert results[name]["status"] in ("ok", "not available")
        if results[name]["status"] == "not available":
            assert f"{name}: not available" in proc.stdout
