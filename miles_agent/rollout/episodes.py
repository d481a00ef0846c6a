"""Running episodes: one task through harness, environment and sandbox, many of them concurrently.

Ownership rule: the episode owns its environment session and its sandbox until scoring is done,
then closes both, whatever happened.

Two kinds of failure, told apart and counted separately:

* infrastructure -- a generation aborted because an engine died or restarted, a sandbox or
  environment server that failed (`miles_agent.errors.InfraError`, e.g. SandboxError): the episode is
  re-queued from scratch, up to ``max_retries`` times, never scored 0. One that keeps failing comes
  back ABORTED (not trained on, counted in ``stats.aborted``).
* task -- anything else the environment or harness raises for this task (a broken task, a verifier
  bug): not retried (it would fail again), returned as FAILED and counted in ``stats.failed``.

`RunAborted` and `UserError` end the run: they are about the run, not the episode. Either way
nothing is silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from miles_agent.engine import Policy
from miles_agent.environment import Environment, EnvSession, Harness, Task
from miles_agent.errors import InfraError, RunAborted, UserError
from miles_agent.sandbox import Sandbox, SandboxError
from miles_agent.types import Status, Trajectory

log = logging.getLogger(__name__)


@dataclass
class EpisodeStats:
    retries: int = 0  # attempts re-queued after an infrastructure failure
    aborted: int = 0  # episodes given up after max_retries infrastructure failures (not trained, not scored)
    failed: int = 0  # episodes that failed for a task reason (not retried)
    sandbox_errors: int = 0  # attempts lost to a sandbox failure (each one retried or aborted)
    aborts: int = 0  # attempts whose generation the engine aborted
    reward_out_of_range: int = 0  # episodes whose reward was outside the environment's reward_range
    errors: list[str] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        return {"episode_retries": float(self.retries), "episode_aborted": float(self.aborted),
                "episode_failed": float(self.failed),
                **({"episode_reward_out_of_range": float(self.reward_out_of_range)} if self.reward_out_of_range else {})}


@dataclass
class EpisodeRunner:
    env: Environment
    harness: Harness
    make_sandbox: Callable[[], Sandbox] | None = None
    max_retries: int = 3
    stats: EpisodeStats = field(default_factory=EpisodeStats)
    reward_out_of_range: str = "refuse"  # env.reward_out_of_range: refuse | clip

    async def run(self, task: Task, policy: Policy, group_id: str) -> list[Trajectory]:
        """Play one episode to a scored trajectory, re-queueing it after infrastructure failures."""
        last_error = ""
        for attempt in range(self.max_retries + 1):
            try:
                trajs = await self._attempt(task, policy)
            except InfraError as e:
                last_error = f"{'sandbox' if isinstance(e, SandboxError) else 'infra'}: {e}"
                self.stats.sandbox_errors += int(isinstance(e, SandboxError))
            except (RunAborted, UserError):
                raise
            except Exception as e:  # noqa: BLE001 - a task failure: recorded and returned, not retried
                log.warning("episode %s failed (task error)", task.id, exc_info=True)
                return [self._give_up(task, group_id, Status.FAILED, f"task: {type(e).__name__}: {e}")]
            else:
                if all(t.status is not Status.ABORTED for t in trajs):
                    if (bad := self._out_of_range(trajs)) is not None:
                        return [self._give_up(task, group_id, Status.FAILED, bad)]
                    for t in trajs:  # branches of one episode: one sample in the group statistics
                        t.group_id, t.episode_id = group_id, trajs[0].uid
                        t.metadata["attempts"] = attempt + 1
                    return trajs
                last_error = "generation aborted"
                self.stats.aborts += 1
            self.stats.retries += 1
            log.info("episode %s attempt %d failed (%s); retrying", task.id, attempt + 1, last_error)
        return [self._give_up(task, group_id, Status.ABORTED, last_error)]

    def _out_of_range(self, trajs: list[Trajectory]) -> str | None:
        """Why the episode is refused (a reward outside the env's range, or NaN), after clipping if so set."""
        low, high = getattr(self.env, "reward_range", (0.0, 1.0))
        bad = [t for t in trajs if t.reward is not None and not low <= float(t.reward) <= high]
        self.stats.reward_out_of_range += bool(bad)
        if bad and self.reward_out_of_range == "clip" and not any(math.isnan(t.reward) for t in bad):
            for t in bad:
                t.reward, t.reward_parts["reward_clipped"] = min(max(float(t.reward), low), high), 1.0
            return None
        return None if not bad else f"reward {bad[0].reward:g} outside the environment's reward_range [{low:g}, " \
            f"{high:g}]; refused (env.reward_out_of_range=clip clips it; NaN is always refused)"

    def _give_up(self, task: Task, group_id: str, status: Status, error: str) -> Trajectory:
        if status is Status.ABORTED:
            self.stats.aborted += 1
        else:
            self.stats.failed += 1
        self.stats.errors.append(f"{task.id}: {error}")
        out = Trajectory(prompt_ids=[], task_id=task.id, group_id=group_id, status=status)
        out.metadata["error"] = error
        return out

    async def _attempt(self, task: Task, policy: Policy) -> list[Trajectory]:
        async with self.episode(task) as (session, _sandbox):
            return await self.harness.run(task, session, policy)

    @contextlib.asynccontextmanager
    async def episode(self, task: Task) -> AsyncIterator[tuple[EnvSession, Sandbox | None]]:
        """The episode's session and sandbox; the session is closed, then the sandbox stopped, whatever happens."""
        sandbox = None
        if self.env.needs_sandbox:
            if self.make_sandbox is None:
                raise SandboxError(f"environment {self.env.name!r} needs a sandbox but none is configured")
            sandbox = self.make_sandbox()
            await sandbox.start(self.env.sandbox_spec(task))
        try:
            session = await self.env.open(task, sandbox)
            try:
                yield session, sandbox
            finally:
                await session.close()
        finally:
            if sandbox is not None:
                await sandbox.stop()

async def collect(runner: EpisodeRunner, tasks: list[Task], samples_per_task: int, policy: Policy,
                  concurrency: int, on_done: Callable[[], None] | None = None,
                  group_prefix: str = "") -> list[Trajectory]:
    """Run every task ``samples_per_task`` times; returns trajectories grouped in task order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task, group_id: str) -> list[Trajectory]:
        async with sem:
            out = await runner.run(task, policy, group_id)
        if on_done is not None:
            on_done()
        return out

    jobs = [one(t, f"{group_prefix}{t.id}") for t in tasks for _ in range(samples_per_task)]
    results = await asyncio.gather(*jobs)
    return [traj for episode in results for traj in episode]
