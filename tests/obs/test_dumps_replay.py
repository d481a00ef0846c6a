"""Rollout dumps hold exactly what the trainer saw; replaying them reproduces the run's train metrics."""

from __future__ import annotations

import json

import pytest

from miles_agent.cli import main
from miles_agent.config import load_config
from miles_agent.dumps import RolloutRecorder, list_steps, read_step, step_path
from miles_agent.errors import UserError
from miles_agent.loop import train
from miles_agent.replay import replay
from miles_agent.types import Status, Trajectory

# The shipped warm start, so rewards (and so advantages and gradients) are not all zero.
SMALL = {"rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 4, "run.progress": False}


def _traj(reward: float | None, status: Status = Status.COMPLETED) -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2], task_id=f"t{reward}", status=status)
    if status is not Status.FAILED:
        t.append_model([5, 6], [-0.5, -0.25], weight_version=3, turn=0)
        t.append_observation([7], turn=0)
        t.reward = reward
    return t


def test_recorder_writes_trained_first_with_advantages_and_samples(tmp_path):
    trajs = [_traj(0.0), _traj(None, Status.FAILED), _traj(1.0)]
    trained = [trajs[2], trajs[0]]  # trainer order differs from rollout order
    advantages = [[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]]
    rec = RolloutRecorder(tmp_path, every=2, samples=2)
    assert rec.record(0, trajs, trained, advantages) == step_path(tmp_path / "rollouts", 0)
    assert rec.record(1, trajs, trained, advantages) is None  # every 2nd step only
    dump = read_step(step_path(tmp_path / "rollouts", 0))
    assert dump.step == 0 and [t.uid for t in dump.trajectories] == [trajs[2].uid, trajs[0].uid, trajs[1].uid]
    assert dump.advantages == [[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0], None]
    got_trajs, got_adv = dump.train_batch()
    assert [t.uid for t in got_trajs] == [t.uid for t in trained] and got_adv == advantages
    assert got_trajs[0].tokens == [1, 2, 5, 6, 7] and got_trajs[0].rollout_logprobs == [-0.5, -0.25, 0.0]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["reward"]) for s in samples] == [(0, 1.0), (0, 0.0), (1, 1.0), (1, 0.0)]
    # a resumed run (from step 1) drops the samples of the steps it redoes
    RolloutRecorder(tmp_path, every=2, samples=2, start_step=1)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2
    assert list_steps(tmp_path) == [0]


def test_replay_reproduces_the_train_metrics_of_the_original_steps(tmp_path):
    cfg = load_config("tiny-cpu", {**SMALL, "run.steps": 2, "run.run_dir": str(tmp_path), "run.dump_rollouts": 1})
    original = train(cfg)
    assert list_steps(tmp_path) == [0, 1]
    replayed = replay(tmp_path)
    assert [r["step"] for r in replayed] == [0, 1]
    for orig, rep in zip(original, replayed):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/tokens",
                    "train/logprob_mismatch_mean", "train/logprob_mismatch_max"):
            assert rep[key] == pytest.approx(orig[key], rel=1e-6, abs=1e-9), key
            assert rep[f"original/{key}"] == orig[key]
    assert all(r["train/grad_norm"] > 0 for r in original)  # real updates, not zero-advantage batches
    assert original[1]["train/grad_norm"] != original[0]["train/grad_norm"]  # two different batches

    # the CLI replays one step with a changed config (lr does not change step 0's pre-update metrics)
    out = tmp_path / "replayed.jsonl"
    assert main(["replay", str(tmp_path), "train.lr=1e-3", "--to", "0", "--out", str(out)]) == 0
    (step0,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert step0["train/lr"] == 1e-3 and step0["train/loss"] == pytest.approx(original[0]["train/loss"], rel=1e-6)


def test_replay_errors_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="run.dump_rollouts=1"):
        replay(tmp_path)
    (tmp_path / "rollouts").mkdir()
    step_path(tmp_path / "rollouts", 3).write_text("")
    (tmp_path / "config.json").write_text(json.dumps(load_config("tiny-cpu").to_dict()))
    with pytest.raises(UserError, match="needs the weights the run had then"):
        replay(tmp_path)
