"""Scoring a policy on an environment's tasks: the model (through the embedded engine) or the oracle.

Every eval writes a job folder, as Harbor's job directory does: ``RUN_DIR/eval/<time>/results.jsonl``
(one line per task: reward, its parts, the reason of every reward below 1, which backend ran it and
why, exit codes, the verifier's output tail, durations), ``summary.json``, and per task
``<task>/verifier/test-stdout.txt``. What an environment knows beyond the reward comes from its
session's ``result_details()`` and the sandbox's ``route`` (both optional)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from miles_agent import registry
from miles_agent.build import EMBEDDED_ENGINE, build_env, build_harness, check_device, env_sandboxes
from miles_agent.config import Config
from miles_agent.environment import split_tasks
from miles_agent.errors import UserError
from miles_agent.metrics import rollout_metrics
from miles_agent.rollout.episodes import EpisodeRunner, collect
from miles_agent.sandbox import SandboxError

FAILURE_PARTS = ("verifier_setup_failed", "verifier_timed_out", "reward_file_missing", "reward_file_garbled")


@dataclass
class EvalReport:
    """What an eval measured: the metrics (``reward_mean``, ``episodes``, ``failed`` ...), one row per
    task, and the job folder they were written to (None: not written)."""

    metrics: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)
    job_dir: Path | None = None

    def __getitem__(self, key: str) -> float:  # the metrics, as the plain dict this used to be
        return self.metrics[key]


async def evaluate(cfg: Config, policy: str = "model", split: str = "eval", limit: int | None = None,
                   job_dir: str | Path | None = None) -> EvalReport:
    env = build_env(cfg, model_plays=policy == "model")
    if policy == "oracle" and getattr(env, "oracle_source", None) == "":  # declared: nothing to play
        raise UserError(f"--policy oracle on {env.name}: the ecosystem publishes no reference solution to play; "
                        "use --policy model")
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: evaluate at least 1 task (or leave --limit out for all)")
    tasks = split_tasks(env, split)[:limit]
    engine: Any = None
    make_sandbox = env_sandboxes(cfg, env)
    job = Path(job_dir) if job_dir else Path(cfg.run.run_dir) / "eval" / datetime.now().strftime("%Y%m%d-%H%M%S")
    if policy == "oracle" and hasattr(env, "oracle_solve"):
        runner = EpisodeRunner(env, harness=None, make_sandbox=make_sandbox)  # type: ignore[arg-type]
        rows = await _solve_with_oracle(runner, tasks, cfg.rollout.concurrency) + _refused(env, tasks, limit)
        return write_job(job, rows, {"env": cfg.env.name, "split": split, "policy": policy,
                                     "sandbox": cfg.env.sandbox})
    if policy == "oracle":
        if not hasattr(env, "oracle_policy"):
            raise UserError(f"environment {env.name!r} has no oracle; use --policy model")
        from miles_agent.models.tokenizer import build_byte_tokenizer

        tokenizer = build_byte_tokenizer()
        pol = env.oracle_policy(tokenizer)
    elif policy == "model":
        from miles_agent.models.loading import load_policy

        check_device(cfg.model.device)
        model, tokenizer = load_policy(cfg, env)
        engine = pol = registry.load("engines", EMBEDDED_ENGINE)(cfg, model, tokenizer)[0]
    else:
        raise UserError(f"unknown --policy {policy!r}; use 'model' or 'oracle'")
    try:
        runner = EpisodeRunner(env, build_harness(cfg, env, tokenizer), make_sandbox=make_sandbox,
                                reward_out_of_range=cfg.env.reward_out_of_range)
        trajs = await collect(runner, tasks, 1, pol, cfg.rollout.concurrency)
    finally:
        if engine is not None:
            await engine.shutdown()
    rows = [_row(t.task_id, t.reward, t.reward_parts, t.metadata.get("error"),
                 {"status": t.status.value, "attempts": t.metadata.get("attempts")}) for t in trajs]
    rows += _refused(env, tasks, limit)
    return write_job(job, rows, {"env": cfg.env.name, "split": split, "policy": policy, "sandbox": cfg.env.sandbox},
                     rollout_metrics(trajs))


async def score_policy(cfg: Config, env: Any, tokenizer: Any, policy: Any, tasks: list[Any],
                       make_sandbox: Any = None) -> dict[str, float]:
    """Each task played once by ``policy`` through the configured harness: the rollout metrics
    (``reward_mean``, ``episodes``, ``failed`` ...), for ``run.eval_every``."""
    runner = EpisodeRunner(env, build_harness(cfg, env, tokenizer), make_sandbox=make_sandbox,
                           reward_out_of_range=cfg.env.reward_out_of_range)
    return rollout_metrics(await collect(runner, tasks, 1, policy, cfg.rollout.concurrency))


async def _solve_with_oracle(runner: EpisodeRunner, tasks: list[Any], concurrency: int) -> list[dict[str, Any]]:
    """Environments whose oracle is a script (terminal-bench's solve.sh): run it, then the verifier;
    one row per task. A task that fails (a setup step, a refused route, a sandbox that keeps failing)
    is a row with its error, never the end of the eval."""
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Any) -> dict[str, Any]:
        start, extra, parts, reward, error, attempts = time.monotonic(), {}, {}, None, None, 0
        async with sem:
            while attempts <= runner.max_retries:
                attempts += 1
                try:
                    async with runner.episode(task) as (session, sandbox):
                        extra = {"route": getattr(sandbox, "route", None) or {"backend": getattr(sandbox, "name", None)}}
                        solved = await runner.env.oracle_solve(task, sandbox)
                        if solved is not None:  # a script's result (solve.sh); a side-car's oracle returns none
                            extra |= {"solve_exit_code": solved.exit_code,
                                      "solve_duration_s": round(solved.duration_s, 3)}
                            if solved.exit_code != 0:
                                extra["solve_tail"] = (solved.stdout + solved.stderr)[-2000:]
                        scored = await session.score([])
                        reward, parts = scored.value, dict(scored.parts)
                        details = getattr(session, "result_details", None)
                        extra |= details() if callable(details) else {}
                    error = None
                    break
                except SandboxError as e:  # the sandbox's failure: retried like an episode, then recorded
                    error = f"sandbox: {e}"
                except Exception as e:  # noqa: BLE001 - one task's failure is its row, not the eval's end
                    error = f"{type(e).__name__}: {e}"
                    break
        extra["attempts"] = attempts
        return _row(task.id, reward, parts, error, extra, time.monotonic() - start)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def _refused(env: Any, tasks: list[Any], limit: int | None) -> list[dict[str, Any]]:
    """Rows for the tasks the environment left out of this configuration (its ``excluded``: a task
    that needs a container no engine can give), each with the one-line reason."""
    if limit:
        return []
    ran = {t.id for t in tasks}
    excluded = getattr(env, "excluded", None) or {}
    return [{"task": name, "reward": None, "parts": {}, "failed": False, "refused": True, "reason": why,
             "route": {"backend": "refused", "reason": why}} for name, why in sorted(excluded.items()) if name not in ran]


def _row(task_id: str, reward: float | None, parts: dict[str, float], error: str | None, extra: dict[str, Any],
         duration_s: float | None = None) -> dict[str, Any]:
    """One task's result, with the reason of any reward below 1 (its error, a failure part, or the
    verifier's verdict)."""
    reason = None
    if error:
        reason = error
    elif reward is None or reward < 1:
        named = [p for p in FAILURE_PARTS if parts.get(p)]
        tail = (extra.get("verifier_tail") or "").strip().splitlines()
        code = extra.get("verifier_exit_code", parts.get("verifier_exit_code"))  # the model policy: in the parts
        reason = "; ".join(filter(None, [", ".join(named), extra.get("reward_reason")])) or (f"tests failed (verifier exit {int(code)}): {tail[-1][:200] if tail else 'no output'}"
                                      if code is not None else f"reward {reward}")
        if extra.get("solve_exit_code"):
            reason = f"solve.sh exited {extra['solve_exit_code']}; {reason}"
    row = {"task": task_id, "reward": reward, "parts": parts, "failed": error is not None, "reason": reason, **extra}
    if duration_s is not None:
        row["duration_s"] = round(duration_s, 3)
    return row


def write_job(job: Path, rows: list[dict[str, Any]], about: dict[str, Any],
              metrics: dict[str, float] | None = None) -> EvalReport:
    """The job folder: results.jsonl, summary.json, and each task's verifier output."""
    scored = [r["reward"] for r in rows if not r["failed"] and r["reward"] is not None]
    out = dict(metrics or {})
    refused = sum(bool(r.get("refused")) for r in rows)
    out |= {"episodes": float(len(rows) - refused), "failed": float(sum(r["failed"] for r in rows)),
            "refused": float(refused),
            "reward_mean": sum(scored) / len(scored) if scored else float("nan"),
            "solved": float(sum(1 for r in scored if r >= 1))}
    job.mkdir(parents=True, exist_ok=True)
    with open(job / "results.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if k != "verifier_stdout"}) + "\n")
            if row.get("verifier_stdout") is not None:
                trial = job / _safe(row["task"]) / "verifier"
                trial.mkdir(parents=True, exist_ok=True)
                (trial / "test-stdout.txt").write_text(row["verifier_stdout"])
    summary = {**about, **out, "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
               "below_1": {r["task"]: r["reason"] for r in rows if r["reason"]}}
    (job / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return EvalReport(out, rows, job)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The per-task table the CLI prints: task, reward, backend, seconds, and the reason below 1."""
    width = max([len(r["task"]) for r in rows] + [4])
    lines = [f"{'task':<{width}}  reward  backend  time_s  reason"]
    for r in rows:
        reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
        backend = ((r.get("route") or {}).get("backend") or "-")[:7]
        lines.append(f"{r['task']:<{width}}  {reward:>6}  {backend:<7}  {r.get('duration_s', 0):>6.1f}  "
                     f"{(r['reason'] or '')[:160]}")
    return "\n".join(lines)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "task"
