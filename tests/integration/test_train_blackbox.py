"""`miles-agent train --env arith-tools env.harness=black-box` with the shipped example agent program: each
episode is a subprocess speaking only the OpenAI API to the proxy; the loop trains on what the proxy recorded."""

from __future__ import annotations

import json
import sys

import pytest

from miles_agent.cli import main

pytest.importorskip("aiohttp")
pytest.importorskip("openai")


def test_train_with_a_black_box_agent_program(tmp_path, capsys):
    agent = f"{sys.executable} -m miles_agent.harnesses.agents.openai_tool_loop"
    rc = main(["train", "--env", "arith-tools", "--recipe", "tiny-cpu", "--run-dir", str(tmp_path), "--steps", "2",
               "--no-progress", "env.harness=black-box", f"env.agent={agent}", "rollout.prompts_per_step=2",
               "rollout.samples_per_prompt=2"])
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["episodes"] == 4 and r["failed"] == 0, r
        assert r["sampled_tokens"] > 0 and 0.0 <= r["reward_mean"] <= 1.0
        assert r["train/logprob_mismatch_mean"] < 1e-3  # the proxy recorded exactly what the engine sampled
    assert records[1]["weight_version"] == 1
    assert (tmp_path / "final" / "config.json").is_file()
    assert "done: reward" in capsys.readouterr().out
