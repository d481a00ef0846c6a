"""Running episodes: one task through harness, environment and sandbox, many of them concurrently.

Ownership rule: the episode owns its environment session and its sandbox until scoring is done,
then closes both, whatever happened. Infrastructure failures (an aborted generation, a sandbox
error) are retried and counted -- never scored 0 -- and an episode that keeps failing is returned
as FAILED, so nothing is silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from miles_agent.engine import Policy
from miles_agent.environment import Environment, EnvSession, Harness, Task
from miles_agent.sandbox import Sandbox, SandboxError
from miles_agent.types import Status, Trajectory

log = logging.getLogger(__name__)


@dataclass
class EpisodeStats:
    retries: int = 0
    failed: int = 0
    sandbox_errors: int = 0  # attempts lost to a sandbox failure (each one retried or failed)
    aborts: int = 0  # attempts whose generation the engine aborted
    errors: list[str] = field(default_factory=list)


@dataclass
class EpisodeRunner:
    env: Environment
    harness: Harness
    make_sandbox: Callable[[], Sandbox] | None = None
    max_retries: int = 3
    stats: EpisodeStats = field(default_factory=EpisodeStats)

    async def run(self, task: Task, policy: Policy, group_id: str) -> list[Trajectory]:
        """Play one episode to a scored trajectory, retrying infrastructure failures."""
        last_error = ""
        for attempt in range(self.max_retries + 1):
            try:
                trajs = await self._attempt(task, policy)
            except SandboxError as e:
                last_error = f"sandbox: {e}"
                self.stats.sandbox_errors += 1
            else:
                if all(t.status is not Status.ABORTED for t in trajs):
                    for t in trajs:  # branches of one episode: one sample in the group statistics
                        t.group_id, t.episode_id = group_id, trajs[0].uid
                        t.metadata["attempts"] = attempt + 1
                    return trajs
                last_error = "generation aborted"
                self.stats.aborts += 1
            self.stats.retries += 1
            log.info("episode %s attempt %d failed (%s); retrying", task.id, attempt + 1, last_error)
        self.stats.failed += 1
        self.stats.errors.append(f"{task.id}: {last_error}")
        failed = Trajectory(prompt_ids=[], task_id=task.id, group_id=group_id, status=Status.FAILED)
        failed.metadata["error"] = last_error
        return [failed]

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
