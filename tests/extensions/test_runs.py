"""Whole runs through `miles-agent train`: math RLVR from a JSONL file in one command, two environments
with per-environment metrics and eval rows, and a user package plugged in by dotted path only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_agent.cli import main

TINY = ["model.warm_start=null", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "env.max_new_tokens_per_turn=8", "env.max_turns=1"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def math_jsonl(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{a}+{b}=? Answer in \\boxed{{}}.", "solution": str(a + b)}) + "\n"
                            for a in range(4) for b in range(5)))
    return path


def test_math_rlvr_from_a_jsonl_file_is_one_command(tmp_path, math_jsonl):
    run = tmp_path / "run"
    assert main(["train", "--recipe", "tiny-cpu", "--env", "dataset", "--no-progress", "--steps", "2",
                 "--run-dir", str(run), f"env.options.path={math_jsonl}", "env.options.reward=math",
                 "env.options.prompt_field=problem", "env.options.answer_field=solution", "run.eval_every=2", *TINY]) == 0
    logged = rows(run / "metrics.jsonl")
    assert [r["step"] for r in logged] == [0, 1] and all(r["episodes"] == 4 and r["failed"] == 0 for r in logged)
    assert all("reward/correct" in r for r in logged) and "eval/reward_mean" in logged[1]
    (evaluated,) = rows(run / "eval.jsonl")
    assert evaluated["step"] == 1 and evaluated["split"] == "eval" and evaluated["episodes"] == 2  # 10% of 20 rows
    assert (run / "final" / "model.safetensors").is_file()


def test_two_environments_log_per_environment_metrics_and_eval_rows(tmp_path, math_jsonl):
    run = tmp_path / "mix"
    assert main(["train", "--recipe", "tiny-cpu", "--env", "mix", "--no-progress", "--steps", "2", "--run-dir",
                 str(run), "env.mix=arith-tools:0.5,dataset:0.5", f"env.options.dataset.path={math_jsonl}",
                 "env.options.dataset.prompt_field=problem", "env.options.dataset.answer_field=solution",
                 "env.options.arith-tools.num_tasks=32", "rollout.prompts_per_step=4", "run.eval_every=1",
                 *TINY[:1], *TINY[2:]]) == 0
    logged = rows(run / "metrics.jsonl")
    for r in logged:
        per_env = {k: v for k, v in r.items() if k.startswith("env/")}
        assert sum(v for k, v in per_env.items() if k.endswith("/episodes")) == r["episodes"] == 8
        assert 0.0 <= per_env.get("env/dataset/pass_rate", 0.0) <= 1.0
    assert {k.split("/")[1] for r in logged for k in r if k.startswith("env/")} == {"arith-tools", "dataset"}
    evals = rows(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1]
    assert evals[0]["env/arith-tools/episodes"] == 64 and evals[0]["env/dataset/episodes"] == 2
    assert logged[0]["eval/env/dataset/episodes"] == 2


def test_mix_options_must_be_per_environment(tmp_path, capsys):
    assert main(["train", "--recipe", "tiny-cpu", "--env", "mix", "--no-progress", "--run-dir", str(tmp_path),
                 "env.mix=arith-tools:1", "env.options.num_tasks=3"]) != 0
    assert "env.options.<name>.<key>" in capsys.readouterr().err


USER_PACKAGE = {
    "__init__.py": '''
        import json, os

        def log(kind, **info):
            with open(os.environ["USERFNS_LOG"], "a") as f:
                f.write(json.dumps({"kind": kind, **info}) + "\\n")
    ''',
    "scoring.py": '''
        from userfns import log

        async def episode(task, messages, env_reward):
            log("reward", task=task.id, last_role=messages[-1]["role"])
            return 1.0

        def group(task, responses, trajectories):
            log("group_reward", task=task.id, responses=[type(r).__name__ for r in responses])
            return [t.reward * (i + 1) for i, t in enumerate(trajectories)]

        def post(rewards, trajectories):
            log("reward_post", rewards=rewards)
            return [r / 2 for r in rewards]
    ''',
    "learning.py": '''
        from userfns import log

        def advantage(rewards, group_ids, *, trajectories, algo):
            log("advantage", rewards=rewards)
            return [r - 0.75 for r in rewards]

        def loss(logp, old_logp, advantages, *, mask, clip_eps, clip_eps_high, dual_clip_c):
            log("loss", rows=logp.shape[0])
            return -logp * advantages, None

        def reducer(values, mask, *, num_tokens, num_seqs, row_weights):
            log("reducer", num_seqs=num_seqs)
            return (values * mask).sum() / num_tokens

        def mask_filter(trajectory):
            log("mask_filter")
            return True

        def buffer(trajectories):
            log("buffer_filter", n=len(trajectories))
            return trajectories
    ''',
    "hooks.py": '''
        from userfns import log

        class Tracker:
            def on_run_start(self, run):
                log("on_run_start")
                return {"started": 1}

            def after_rollout(self, step, trajectories):
                log("after_rollout", step=step, n=len(trajectories))

            def before_train_step(self, step, batch):
                log("before_train_step", step=step, n=len(batch.trajectories))

            def after_train_step(self, step, metrics):
                log("after_train_step", step=step)
                return {"grad_norm_seen": metrics["grad_norm"]}

            def after_weight_sync(self, step, version):
                log("after_weight_sync", step=step, version=version)

            def on_checkpoint(self, step, path):
                log("on_checkpoint", step=step, exists=path.is_dir())
                return {"saved": step}

            def on_run_end(self, run, records):
                log("on_run_end", n=len(records))
                return {"done": 1}

        class Sink:
            def __init__(self, run_dir, config, resume):
                log("sink_open", resume=resume)

            def write(self, record):
                log("sink_write", step=record["step"], hooks=sorted(k for k in record if k.startswith("hooks/")))

            def close(self):
                log("sink_close")

        def rollout(ctx):
            raise AssertionError("not used in this run")
    ''',
}


@pytest.mark.parametrize("how", ["in_process", pytest.param("subprocess", marks=pytest.mark.slow)])
def test_a_user_package_plugs_in_by_dotted_path_only(tmp_path, monkeypatch, how):
    """The package lives outside the project and reaches the run through PYTHONPATH and config keys alone
    (in process: its folder on sys.path, as PYTHONPATH puts it; nightly: a fresh `python -m` process)."""
    pkg = tmp_path / "site" / "userfns"
    pkg.mkdir(parents=True)
    for name, source in USER_PACKAGE.items():
        (pkg / name).write_text(textwrap.dedent(source))
    log, run = tmp_path / "calls.jsonl", tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "USERFNS_LOG": str(log), "OMP_NUM_THREADS": "1"}
    keys = ["env.reward=userfns.scoring:episode", "env.group_reward=userfns.scoring:group",
            "env.reward_post=userfns.scoring:post", "algo.advantage=userfns.learning:advantage",
            "algo.loss=userfns.learning:loss", "algo.loss_agg=userfns.learning:reducer",
            "algo.loss_mask_filter=userfns.learning:mask_filter", "rollout.buffer_filter=userfns.learning:buffer",
            "run.hooks=userfns.hooks:Tracker", "run.sinks=userfns.hooks:Sink"]
    args = ["train", "--recipe", "tiny-cpu", "--env", "arith-tools", "--no-progress", "--steps", "2",
            "--run-dir", str(run), *TINY, *keys]
    if how == "subprocess":
        done = subprocess.run([sys.executable, "-m", "miles_agent.cli", *args], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        monkeypatch.setenv("USERFNS_LOG", str(log))
        try:
            assert main(args) == 0
        finally:
            for name in [m for m in sys.modules if m == "userfns" or m.startswith("userfns.")]:
                del sys.modules[name]
    calls = rows(log)
    kinds = [c["kind"] for c in calls]
    by = {k: [c for c in calls if c["kind"] == k] for k in kinds}
    assert len(by["reward"]) == 8 and all(c["last_role"] == "assistant" for c in by["reward"])
    assert len(by["group_reward"]) == 4 and all(c["responses"] == ["str", "str"] for c in by["group_reward"])
    assert [c["rewards"] for c in by["reward_post"]] == [[1.0, 2.0, 1.0, 2.0]] * 2  # the group's output
    assert [c["rewards"] for c in by["advantage"]] == [[0.5, 1.0, 0.5, 1.0]] * 2  # post-processed
    assert len(by["mask_filter"]) == 8 and [c["n"] for c in by["buffer_filter"]] == [4, 4]
    assert by["loss"] and by["reducer"] and all(c["num_seqs"] > 0 for c in by["reducer"])
    order = [k for k in kinds if k in ("on_run_start", "after_rollout", "before_train_step", "after_train_step",
                                       "after_weight_sync", "on_checkpoint", "on_run_end")]
    assert order == ["on_run_start", *["after_rollout", "before_train_step", "after_train_step",
                                       "after_weight_sync"] * 2, "on_checkpoint", "on_run_end"]
    assert by["on_checkpoint"] == [{"kind": "on_checkpoint", "step": 2, "exists": True}]
    assert [c["hooks"] for c in by["sink_write"]] == [["hooks/grad_norm_seen", "hooks/started"],
                                                      ["hooks/grad_norm_seen"]]
    assert kinds[0] == "sink_open" and kinds[-1] == "sink_close"
    logged = rows(run / "metrics.jsonl")
    assert [r["reward_mean"] for r in logged] == [0.75, 0.75] and "hooks/started" in logged[0]
    assert json.loads((run / "hooks_final.json").read_text()) == {"hooks/saved": 2, "hooks/done": 1}


def test_a_user_rollout_function_and_group_filter(tmp_path, user_module):
    user_module("rollout_user", '''
        SEEN = []

        async def rollout(ctx):
            SEEN.append((ctx.step, [t.id for t in ctx.tasks], ctx.samples_per_prompt))
            out = []
            for i, task in enumerate(ctx.tasks):
                for _ in range(ctx.samples_per_prompt + 1):  # one extra sample per group: the function decides
                    out += await ctx.play(task, f"step{ctx.step}-{i}")
            return out

        GROUPS = []

        def keep(group):
            GROUPS.append(len(group))
            return True
    ''')
    import rollout_user

    assert main(["train", "--recipe", "tiny-cpu", "--env", "arith-tools", "--no-progress", "--steps", "2",
                 "--run-dir", str(tmp_path / "a"), *TINY, "rollout.function=rollout_user:rollout"]) == 0
    assert [(s, len(ids), k) for s, ids, k in rollout_user.SEEN] == [(0, 2, 2), (1, 2, 2)]
    assert rollout_user.SEEN[0][1] != rollout_user.SEEN[1][1]  # the sampler moves on
    assert [r["episodes"] for r in rows(tmp_path / "a" / "metrics.jsonl")] == [6, 6]
    assert main(["train", "--recipe", "tiny-cpu", "--env", "arith-tools", "--no-progress", "--steps", "1",
                 "--run-dir", str(tmp_path / "b"), *TINY, "rollout.group_filter=rollout_user:keep"]) == 0
    assert rollout_user.GROUPS == [2, 2]
