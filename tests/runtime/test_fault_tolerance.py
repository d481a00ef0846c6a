"""Engines killed at random moments while rollouts are in flight: every task handed out is trained on
exactly once, and the run finishes. A trainer rank that dies leaves a checkpoint the run resumes from.

The CI test kills 3 times; the slow one kills 20 times (each replacement starts a fresh process that
imports torch, a few seconds each on a laptop).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import pytest

from miles_agent.config import load_config
from miles_agent.errors import RunAborted
from miles_agent.loop import Run, train

SAMPLES = 2
TINY = {"model.warm_start": None, "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": SAMPLES,
        "env.max_new_tokens_per_turn": 8, "env.max_turns": 2, "run.progress": False,
        "cluster.mode": "ray", "cluster.health_check_interval_s": 0.5,
        "rollout.prefix_cache_mb": 0}  # the chaos delays are sized for uncached rollouts (a cached one ends first)


class Chaos:
    """During each rollout, kill up to ``per_step`` engines that have requests in flight: each kill fires at
    a seeded random request of the rollout's first turn plus a random delay, so it lands mid-rollout however
    fast the engine is (a wall-clock delay alone missed whole rollouts once the engine got faster). A kill
    the rollout ended too soon for carries over to the next step. The last ``calm_steps`` rollouts see no
    kill: a request killed there may belong to work the run never collects, so no restart would follow."""

    def __init__(self, ray, run: Run, kills: int, per_step: int, seed: int, calm_steps: int = 1) -> None:
        self.ray, self.run, self.left, self.per_step = ray, run, kills, per_step
        self.rollouts_under_fire = run.cfg.run.steps - calm_steps
        self.rng = random.Random(seed)
        self.killed: list[int] = []
        self.victims: list = []  # the actor handles killed
        self.requests = 0  # requests sent in this rollout
        self._fire_at: list[int] = []  # request numbers at which a kill fires, this rollout
        self._fire = asyncio.Queue()
        next_batch, generate = run.scheduler.next_batch, run.engine.generate
        first_turn = run.cfg.rollout.prompts_per_step * run.cfg.rollout.samples_per_prompt

        async def rollout_under_fire(*args, **kwargs):
            self.requests, self._fire = 0, asyncio.Queue()
            kills = min(self.per_step, self.left) if self.rollouts_under_fire > 0 else 0
            self.rollouts_under_fire -= 1
            self._fire_at = sorted(self.rng.randint(1, first_turn) for _ in range(kills))
            attack = asyncio.ensure_future(self._attack(len(self._fire_at)))
            try:
                return await next_batch(*args, **kwargs)
            finally:
                attack.cancel()

        async def generate_under_fire(*args, **kwargs):
            self.requests += 1
            for _ in range(self._fire_at.count(self.requests)):
                self._fire.put_nowait(self.requests)
            return await generate(*args, **kwargs)

        run.scheduler.next_batch, run.engine.generate = rollout_under_fire, generate_under_fire

    async def _attack(self, kills: int) -> None:
        for _ in range(kills):
            await self._fire.get()
            await asyncio.sleep(self.rng.uniform(0.0, 0.03))
            # not an actor already killed whose death the supervisor has not noticed yet (it is still "ready")
            while not (busy := [s for s in self.run.engine._slots
                                if s.ready and s.inflight > 0 and s.actor not in self.victims]):
                await asyncio.sleep(0.002)
            victim = self.rng.choice(busy)
            self.victims.append(victim.actor)
            self.ray.kill(victim.actor)
            self.killed.append(victim.index)
            self.left -= 1


def record_tasks(run: Run) -> tuple[list[str], list[str]]:
    """(task ids the sampler handed out, task ids of the episodes the trainer trained on)."""
    handed, trained = [], []
    take, train_step = run.sampler.take, run.trainer.train_step

    def take_and_note(n):
        tasks = take(n)
        handed.extend(t.id for t in tasks)
        return tasks

    def train_and_note(batch):
        trained.extend(t.task_id for t in batch.trajectories if t.metadata.get("branch", 0) == 0)
        return train_step(batch)

    run.sampler.take, run.trainer.train_step = take_and_note, train_and_note
    return handed, trained


def run_under_fire(ray, tmp_path, kills: int, per_step: int, spare_steps: int, engines: int = 2):
    steps = -(-kills // per_step) + spare_steps
    cfg = load_config("tiny-cpu", {**TINY, "cluster.num_engines": engines, "run.steps": steps,
                                   "run.run_dir": str(tmp_path)})
    run = Run(cfg)
    run.runner.max_retries = 20  # an episode may be hit by several kills in a row; it must still be trained
    handed, trained = record_tasks(run)
    chaos = Chaos(ray, run, kills, per_step, seed=kills)

    async def main():
        try:
            return await run.train()
        finally:
            await run.engine.shutdown()
            run.trainer.close()

    records = asyncio.run(main())
    assert len(chaos.killed) == kills and len(records) == steps
    assert Counter(trained) == Counter(t for t in handed for _ in range(SAMPLES))
    assert run.engine.stats["restarts"] >= kills
    assert run.engine.stats["aborted_requests"] >= kills  # every kill hit requests in flight
    assert run.runner.stats.retries >= kills and run.runner.stats.aborted == run.runner.stats.failed == 0
    assert records[-1]["episode_retries"] == run.runner.stats.retries
    return records


def test_engines_killed_mid_rollout_lose_no_task(ray_session, tmp_path):
    run_under_fire(ray_session, tmp_path, kills=3, per_step=1, spare_steps=2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_engine_kills_lose_no_task(ray_session, tmp_path):
    # Spare steps for a kill the rollout ended too soon for (its request finished and no other was in flight).
    run_under_fire(ray_session, tmp_path, kills=20, per_step=2, spare_steps=3)


def test_a_dead_trainer_rank_leaves_a_checkpoint_the_run_resumes_from(ray_session, tmp_path):
    cfg = load_config("tiny-cpu", {**TINY, "run.steps": 3, "run.checkpoint_every": 1, "run.run_dir": str(tmp_path)})
    run = Run(cfg)
    train_step, calls = run.trainer.train_step, []

    def dies_at_the_second_step(batch):
        calls.append(1)
        if len(calls) == 2:
            run.trainer.actors[0].crash.remote()
        return train_step(batch)

    run.trainer.train_step = dies_at_the_second_step

    async def main():
        try:
            return await run.train()
        finally:
            await run.engine.shutdown()
            run.trainer.close()

    with pytest.raises(RunAborted, match="rerun with --resume"):
        asyncio.run(main())
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_1"
    # The checkpoint is whole: the run resumes from it (here in one process: DCP shards load at any size).
    records = train(load_config("tiny-cpu", {**TINY, "cluster.mode": "inprocess", "run.steps": 3,
                                             "run.checkpoint_every": 1, "run.run_dir": str(tmp_path)}), resume=True)
    assert [r["step"] for r in records] == [1, 2]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2]
