"""Per-step observability numbers: staleness, length spread and failure deltas, computed by hand."""

from __future__ import annotations

from types import SimpleNamespace

from miles_agent.metrics import summary_line
from miles_agent.observe import StepObserver, staleness, staleness_metrics
from miles_agent.progress import Progress
from miles_agent.types import Status, Trajectory


def _traj(versions: list[int], n_tokens: int = 2, status: Status = Status.COMPLETED) -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2, 3], status=status)
    for turn, v in enumerate(versions):
        t.append_model([9] * n_tokens, [-0.1] * n_tokens, weight_version=v, turn=turn)
    t.reward = 0.0
    return t


def test_staleness_is_the_oldest_span_behind_the_trainer():
    assert staleness(_traj([5, 7]), trainer_version=7) == 2
    assert staleness(Trajectory(prompt_ids=[1]), 3) is None
    m = staleness_metrics([_traj([7]), _traj([6, 7]), _traj([5]), _traj([7])], trainer_version=7)
    assert m == {"staleness/mean": 0.75, "staleness/max": 2.0, "staleness/hist/0": 2.0,
                 "staleness/hist/1": 1.0, "staleness/hist/2": 1.0}


def test_observer_reports_each_steps_share_of_the_counters():
    runner = SimpleNamespace(stats=SimpleNamespace(retries=2, sandbox_errors=1, aborts=1))
    engines = [SimpleNamespace(stats={"failed_steps": 1, "retractions": 0}), SimpleNamespace(stats={})]
    obs = StepObserver(runner, engines)
    runner.stats.retries, runner.stats.sandbox_errors = 5, 3
    engines[0].stats["failed_steps"] = 4
    trajs = [_traj([0], 4), _traj([0], 10), _traj([0], 2, Status.FAILED)]
    trajs[2].reward = None
    r = obs.rollout_record(trajs, trainer_version=0)
    assert r["failures/episode_retries"] == 3 and r["failures/sandbox_errors"] == 2
    assert r["failures/generation_aborts"] == 0 and r["failures/engine_failed_steps"] == 3
    assert r["failures/failed_episodes"] == 1
    assert (r["response_len_min"], r["response_len_max"], r["prompt_len"]) == (4.0, 10.0, 3.0)
    assert obs.rollout_record([], 0)["failures/episode_retries"] == 0  # nothing new since


def test_summary_line_shows_failures_only_when_there_are_some():
    base = {"step": 3, "reward_mean": 0.5, "reward_std": 0.1}
    assert "retries" not in summary_line({**base, "failures/episode_retries": 0.0})
    assert summary_line({**base, "failures/episode_retries": 2.0}).endswith("| retries 2")


def test_progress_counts_in_flight_tokens_micro_batches_and_sync_bytes():
    import torch

    tokens = [100]
    p = Progress(steps=2, enabled=False, generated_tokens=lambda: tokens[0], concurrency=4)
    p.phase("rollout", total=10)
    for _ in range(7):
        p.episode_done()
    tokens[0] = 400
    status = p.rollout_status()
    assert status["in_flight"] == 3.0 and status["tokens_per_s"] > 0  # 3 left, fewer than the cap of 4
    p.phase("train")
    p.micro_batch_done(1, 3)
    p.micro_batch_done(3, 3)
    assert (p.done, p.total) == (3, 3)
    p.phase("sync")
    weights = [("a", torch.zeros(4)), ("b", torch.zeros(2, 2, dtype=torch.float64))]
    assert [n for n, _ in p.track_sync(iter(weights))] == ["a", "b"]
    assert p.done == 16 + 32
    p.close()
