"""Rewards outside the environment's declared range are counted and refused or clipped; every
verifier-side zero carries its reason; a torn JSONL line (what a crash leaves) is dropped and said."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import pytest

from miles_agent.environment import Environment, EnvSession, Harness, Reward, Task
from miles_agent.errors import UserError
from miles_agent.metrics import MetricsLog, read_jsonl, rollout_metrics
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.types import Status, Trajectory

TASK = Task(id="t1", messages=({"role": "user", "content": "hi"},))


class Session(EnvSession):
    async def score(self, messages):
        return Reward(1.0)


class RangedEnv(Environment):
    name = "ranged"

    def tasks(self, split="train"):
        return [TASK]

    async def open(self, task, sandbox=None):
        return Session()


class FixedReward(Harness):
    def __init__(self, reward: float) -> None:
        self.reward = reward

    async def run(self, task, session, policy):
        t = Trajectory(prompt_ids=[1, 2], task_id=task.id, reward=self.reward)
        t.append_model([3], [-0.1], weight_version=0, turn=0)
        return [t]


def play(reward: float, mode: str = "refuse", env: Environment | None = None):
    runner = EpisodeRunner(env or RangedEnv(), FixedReward(reward), reward_out_of_range=mode)
    return asyncio.run(runner.run(TASK, policy=None, group_id="g")), runner


@pytest.mark.parametrize("reward", [5.0, -1.0, math.nan])
def test_an_out_of_range_reward_is_refused_and_counted(reward):
    (t,), runner = play(reward)
    assert t.status is Status.FAILED and t.reward is None  # never reaches the advantages
    assert "reward_range [0, 1]" in t.metadata["error"] or "NaN" in t.metadata["error"]
    assert runner.stats.as_metrics()["episode_reward_out_of_range"] == 1.0


def test_clip_mode_clips_into_range_and_marks_it():
    (t,), runner = play(5.0, "clip")
    assert t.status is Status.COMPLETED and t.reward == 1.0 and t.reward_parts["reward_clipped"] == 1.0
    assert runner.stats.reward_out_of_range == 1
    (t,), _ = play(math.nan, "clip")  # NaN has no nearest bound: refused even so
    assert t.status is Status.FAILED


def test_an_environment_declares_its_own_range():
    class Signed(RangedEnv):
        reward_range = (-1.0, 1.0)

    (t,), runner = play(-1.0, env=Signed())
    assert t.status is Status.COMPLETED and t.reward == -1.0 and runner.stats.reward_out_of_range == 0
    from miles_agent.envs.external.base import ExternalEnvironment

    assert ExternalEnvironment.reward_range == (-math.inf, math.inf)  # the ecosystems bound none


@pytest.mark.parametrize("files, part, says", [
    ({"reward.txt": b"garbage"}, "reward_file_garbled", "reward.txt is not a reward"),
    ({"reward.txt": b"nan"}, "reward_file_garbled", "'nan'"),
    ({"reward.json": b'{"reward": "high"}'}, "reward_file_garbled", "reward.json is not a reward"),
    ({}, "reward_file_missing", "neither reward.json nor reward.txt"),
])
def test_terminal_bench_zero_rewards_carry_their_reason(files, part, says):
    from miles_agent.envs.terminal_bench.env import _reward_from

    reward, why = _reward_from(files)
    assert reward.value == 0.0 and reward.parts[part] == 1.0 and says in why
    traj = Trajectory(prompt_ids=[1], task_id="t", reward=reward.value, reward_parts=dict(reward.parts))
    traj.append_model([3], [-0.1], weight_version=0, turn=0)
    assert rollout_metrics([traj])[f"reward/{part}"] == 1.0  # the metrics (and the report) show it


def test_eval_rows_name_the_reason_of_a_model_policy_zero():
    from miles_agent.evaluate import _row

    row = _row("t", 0.0, {"tests_passed": 0.0, "verifier_timed_out": 1.0}, None, {})
    assert "verifier_timed_out" in row["reason"]
    row = _row("t", 0.0, {"tests_passed": 0.0, "verifier_exit_code": 1.0}, None, {})
    assert "verifier exit 1)" in row["reason"]


def test_the_report_lists_why_rewards_were_zero():
    from miles_agent.report import zero_reasons

    records = [{"step": 0, "reward/verifier_timed_out": 0.5, "episode_reward_out_of_range": 1.0},
               {"step": 1, "reward/verifier_timed_out": 0.0, "episode_reward_out_of_range": 3.0}]
    text = zero_reasons(records)
    assert "verifier_timed_out 25.0%" in text and "reward out of range: 3 episodes" in text


def test_a_non_utf8_instruction_is_a_clear_task_error(tmp_path):
    from miles_agent.envs.terminal_bench.harbor import TaskFormatError, _read_instruction

    (tmp_path / "instruction.md").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(TaskFormatError, match=r"instruction.md is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        _read_instruction(tmp_path)


def test_a_torn_last_line_is_dropped_and_said(tmp_path, caplog):
    log = MetricsLog(tmp_path)
    for step in range(3):
        log.write({"step": step, "reward_mean": 0.5})
    with log.path.open("a") as f:
        f.write('{"step": 3, "rew')  # the kill came mid-write
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in log.read()] == [0, 1, 2]
    assert "last line (4) is torn" in caplog.text


def test_a_bad_line_before_the_end_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="metrics.jsonl line 2 is not JSON"):
        read_jsonl(path)


def test_report_works_on_what_a_crash_leaves(tmp_path):
    pytest.importorskip("matplotlib")
    from miles_agent.report import build_report

    lines = [json.dumps({"step": s, "reward_mean": 0.1 * s, "time/step": 1.0}) for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "rewa')
    (tmp_path / "samples.jsonl").write_text('{"step": 0, "prompt_')
    page = build_report(tmp_path)
    assert "steps recorded</th><td>3" in page.read_text()


def test_report_of_a_run_with_no_step_yet_says_so_and_a_torn_config_is_left_out(tmp_path, caplog):
    pytest.importorskip("matplotlib")
    from miles_agent.report import build_report

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "rew')  # killed mid-way through its first line
    with pytest.raises(UserError, match="holds no finished step yet"):  # was an empty page, said nothing
        build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")
    (tmp_path / "config.json").write_text('{"env": {"na')  # was a JSONDecodeError traceback
    with caplog.at_level(logging.WARNING):
        assert "steps recorded</th><td>1" in build_report(tmp_path).read_text()
    assert "config.json is not JSON" in caplog.text


def test_sft_data_whose_every_episode_is_refused_says_why(tokenizer):
    """An env whose rewards all fall outside its range: the warm start's SFT used to end with 'SFT has no
    trajectory to train on', naming neither the env nor the refusal."""
    from miles_agent import registry
    from miles_agent.envs.arith_tools.env import ArithToolsEnv, ArithToolsSession
    from miles_agent.sft import demonstrations

    class Five(ArithToolsSession):
        async def score(self, messages):
            return Reward(5.0)

    class FiveEnv(ArithToolsEnv):
        name = "five"

        async def open(self, task, sandbox=None):
            return Five(task)

    from miles_agent.engine import SamplingParams
    from miles_agent.environment import HarnessLimits

    harness = registry.load("harnesses", "chat-tools")(tokenizer, HarnessLimits(), SamplingParams(max_new_tokens=128))
    with pytest.raises(UserError, match=r"'five': none of its demonstrator's 3 episodes .*reward_range \[0, 1\]"):
        demonstrations(FiveEnv(num_tasks=3), harness, tokenizer, limit=3)


@pytest.mark.slow
def test_a_step_whose_every_reward_is_refused_stops_the_run_naming_why(tmp_path):
    """Every reward out of range: was a RuntimeError traceback; now the run stops in one line (exit 3)."""
    import os
    import subprocess
    import sys

    mod = tmp_path / "five_env.py"
    mod.write_text("from miles_agent.envs.arith_tools.env import ArithToolsEnv, ArithToolsSession\n"
                   "from miles_agent.environment import Reward\n"
                   "class S(ArithToolsSession):\n    async def score(self, m):\n        return Reward(5.0)\n"
                   "class FiveEnv(ArithToolsEnv):\n    name = 'five'\n"
                   "    async def open(self, task, sandbox=None):\n        return S(task)\n")
    out = subprocess.run([sys.executable, "-m", "miles_agent.cli", "train", "--env", "five_env:FiveEnv", "--run-dir",
                          str(tmp_path / "r"), "--no-progress", "model.warm_start=null", "run.steps=1",
                          "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "every episode failed" in out.stderr and "outside the environment's reward_range [0, 1]" in out.stderr
