"""Scoring a policy on an environment's tasks: the model (through the embedded engine) or the oracle."""

from __future__ import annotations

from typing import Any

from miles_agent import registry
from miles_agent.build import EMBEDDED_ENGINE, build_env, build_harness, check_device, env_sandboxes
from miles_agent.config import Config
from miles_agent.errors import UserError
from miles_agent.metrics import rollout_metrics
from miles_agent.rollout.episodes import EpisodeRunner, collect


async def evaluate(cfg: Config, policy: str = "model", split: str = "eval", limit: int | None = None
                   ) -> dict[str, float]:
    env = build_env(cfg)
    tasks = env.tasks(split)[:limit] if limit else env.tasks(split)
    engine: Any = None
    make_sandbox = env_sandboxes(cfg, env)
    if policy == "oracle" and hasattr(env, "oracle_solve"):
        runner = EpisodeRunner(env, harness=None, make_sandbox=make_sandbox)  # type: ignore[arg-type]
        return await _solve_with_oracle(runner, tasks, cfg.rollout.concurrency)
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
        return await score_policy(cfg, env, tokenizer, pol, tasks, make_sandbox)
    finally:
        if engine is not None:
            await engine.shutdown()


async def score_policy(cfg: Config, env: Any, tokenizer: Any, policy: Any, tasks: list[Any],
                       make_sandbox: Any = None) -> dict[str, float]:
    """Each task played once by ``policy`` through the configured harness: the rollout metrics
    (``reward_mean``, ``episodes``, ``failed`` ...). The CLI's eval and ``run.eval_every`` both use it."""
    runner = EpisodeRunner(env, build_harness(cfg, env, tokenizer), make_sandbox=make_sandbox)
    return rollout_metrics(await collect(runner, tasks, 1, policy, cfg.rollout.concurrency))


async def _solve_with_oracle(runner: EpisodeRunner, tasks: list[Any], concurrency: int) -> dict[str, float]:
    """Environments whose oracle is a script (terminal-bench's solve.sh): run it, then the verifier."""
    import asyncio

    sem = asyncio.Semaphore(concurrency)

    async def one(task: Any) -> float:
        async with sem, runner.episode(task) as (session, sandbox):
            await runner.env.oracle_solve(task, sandbox)
            return (await session.score([])).value

    rewards = await asyncio.gather(*(one(t) for t in tasks))
    n = len(rewards)
    return {"episodes": float(n), "failed": 0.0, "reward_mean": sum(rewards) / n if n else float("nan")}
