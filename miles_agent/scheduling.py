"""Rollout scheduling: which tasks are played when, on which weights, and which samples a step trains on.

Three modes (``rollout.mode``):

* ``sync`` -- batch k is generated with weights k, trained on, then weights k+1 are pushed.
  Staleness 0.
* ``one_step_off`` -- while step k trains, batch k+1 is generated with weights k; the push waits
  until that batch is complete, so every batch is sampled by one version. Staleness exactly 1.
* ``async`` -- episodes run continuously, up to ``max_staleness`` batches ahead of training; a
  weight update lands mid-episode and ``partial_rollout`` says what happens to episodes in flight:
  ``keep`` (pause in place, KV cache kept, continue on the new weights), ``retract`` (drop their KV
  cache, re-prefill on the new weights, continue) or ``abort`` (abort them; the episode restarts
  from its task, counted as ``preempted``). Either way every model span records the version that
  sampled it, so the loss's importance ratio uses the logprobs those weights gave.

Staleness of a sample = the trainer's version - the oldest weight version among its model spans. It
is checked after every generated span (an episode that can no longer be fresh enough stops early)
and again when a batch is assembled; a stale sample is recycled (its episode re-run on newer
weights) or dropped, per ``rollout.stale``, and counted either way. A sample recycled
``rollout.max_recycles`` times that comes back stale again is dropped (``stale_gave_up``): an episode
that can never finish within the bound (a task slower than ``max_staleness`` weight updates) must not
be re-run forever.

R3 (``algo.routing_replay``): each episode attempt calls the engine through its own routing recorder
(`RoutingCapture.episode`); a finished episode gets its routed experts the moment it ends (so they are
saved with it in a checkpoint, and nothing is held for it while it waits for its batch), and the
recorder of any attempt is dropped when the attempt ends.

A group is one task played ``samples_per_prompt`` times, named by its position in the task stream.
Batches are whole groups: in sync and one-step-off mode exactly the next ``prompts_per_step``
positions (deterministic), in async mode the first complete ones (lowest position first).

Checkpoints (`state_dict`): every finished episode not yet trained on is saved in full; episodes in
flight are not saved but regenerated on resume from their task with the same seeds. Sync and
one-step-off runs checkpoint with nothing in flight, so they resume exactly; in async mode the
regenerated episodes sample from the resumed weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from miles_agent.engine import PauseMode, Policy, RolloutEngine
from miles_agent.environment import Task
from miles_agent.errors import UserError
from miles_agent.rollout.episode_policy import EpisodePolicy, Preempted, StaleEpisode
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.rollout.routing_capture import RoutingCapture
from miles_agent.types import Trajectory

MODES = ("sync", "one_step_off", "async")
STALE_POLICIES = ("recycle", "drop")
PAUSE_MODES = {"keep": PauseMode.IN_PLACE, "retract": PauseMode.RETRACT, "abort": PauseMode.ABORT}


@dataclass
class TaskSampler:
    """Deterministic, resumable task order: a fresh seeded shuffle each epoch; position p is one task."""

    tasks: list[Task]
    seed: int
    position: int = 0
    _epoch: int = field(default=-1, repr=False)
    _order: list[int] = field(default_factory=list, repr=False)

    def task_at(self, position: int) -> Task:
        epoch, i = divmod(position, len(self.tasks))
        if epoch != self._epoch:
            self._order = list(range(len(self.tasks)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self.tasks[self._order[i]]

    def take(self, n: int) -> list[Task]:
        out = [self.task_at(self.position + k) for k in range(n)]
        self.position += n
        return out


def staleness(traj: Trajectory, version: int) -> int:
    """How many versions older than ``version`` the oldest model span is (0 with no model span)."""
    return max((version - v for v in traj.weight_versions), default=0)


@dataclass
class Slot:
    """One sample of a group: the episode's trajectories once finished; ``runs`` = attempts started,
    ``recycles`` = of those, re-runs because the sample was stale."""

    runs: int = 0
    recycles: int = 0
    result: list[Trajectory] | None = None
    dropped: bool = False
    job: asyncio.Task | None = field(default=None, repr=False)

    @property
    def settled(self) -> bool:
        return self.result is not None or self.dropped


@dataclass
class Group:
    position: int
    task: Task
    slots: list[Slot]

    @property
    def group_id(self) -> str:
        return f"p{self.position}-{self.task.id}"

    @property
    def complete(self) -> bool:
        return all(s.settled for s in self.slots)

    @property
    def empty(self) -> bool:
        return all(s.dropped for s in self.slots)

    def trajectories(self) -> list[Trajectory]:
        return [t for s in self.slots if s.result for t in s.result]


class RolloutScheduler:
    """Feeds the driver loop whole groups of trajectories, in the configured mode (module docstring)."""

    def __init__(self, runner: EpisodeRunner, sampler: TaskSampler, engine: RolloutEngine,
                 engines: list[RolloutEngine], cfg: Any, seed: int, policy: Policy | None = None,
                 routing: RoutingCapture | None = None) -> None:
        check_config(cfg)
        self.runner, self.sampler, self.engine, self.engines = runner, sampler, engine, engines
        self.policy = policy or engine  # what episodes call (with R3, through a recorder of routing.policy)
        self.routing = routing
        self.mode, self.stale, self.max_staleness = cfg.mode, cfg.stale, cfg.max_staleness
        self.max_recycles = cfg.max_recycles
        self.pause_mode = PAUSE_MODES[cfg.partial_rollout]
        self.per_batch, self.samples = cfg.prompts_per_step, cfg.samples_per_prompt
        self.lookahead = {"sync": 0, "one_step_off": 1, "async": cfg.max_staleness}[cfg.mode]
        self.concurrency, self.seed = cfg.concurrency, seed
        self.groups: dict[int, Group] = {}  # launched and not yet trained on, by position
        self.consumed = 0  # batches handed to the trainer
        self.counts = dict(stale_recycled=0, stale_dropped=0, stale_gave_up=0, preempted=0, groups_dropped=0,
                           groups_filtered=0)
        self.on_episode_done: Callable[[], None] | None = None
        # A filter on complete groups (e.g. DAPO dynamic sampling: keep groups whose rewards differ);
        # a rejected group is counted in groups_filtered and a new task takes its place.
        self.keep_group: Callable[[list[Trajectory]], bool] | None = None
        self._epoch = 0
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._sem: asyncio.Semaphore | None = None

    # -- what the loop calls ------------------------------------------------------------------------
    async def next_batch(self, version: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The next batch's trajectories (whole groups, by position) for a trainer at ``version``,
        and this batch's scheduling metrics."""
        self._bind()
        assert self._changed is not None
        self._top_up()
        while (groups := self._pick(version)) is None:
            self._changed.clear()
            await self._changed.wait()
        for g in groups:
            del self.groups[g.position]
        self.consumed += 1
        trajs = [t for g in groups for t in g.trajectories()]
        metrics = self._batch_metrics(trajs)
        self.counts = dict.fromkeys(self.counts, 0)
        return trajs, metrics

    @contextlib.asynccontextmanager
    async def weight_update(self) -> AsyncIterator[None]:
        """Wrap a weight push. One-step-off: the batch in flight finishes first (one version per batch).
        Async: engines pause in the ``partial_rollout`` mode, and new episodes start after the push."""
        self._bind()
        if self.mode != "async":
            await self._drain()
            yield
            return
        self._epoch += 1  # requests aborted from here on were preempted, not failed
        for e in self.engines:
            await e.pause(self.pause_mode)
        try:
            yield
        finally:
            for e in self.engines:
                await e.resume()
        self._top_up()

    async def close(self) -> None:
        jobs = [s.job for g in self.groups.values() for s in g.slots if s.job is not None and not s.job.done()]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)

    # -- launching ------------------------------------------------------------------------------------
    def _bind(self) -> None:
        """Event-loop state is made in the running loop; jobs of a loop that is gone are started again."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._changed, self._sem = loop, asyncio.Event(), asyncio.Semaphore(self.concurrency)
            for g in self.groups.values():
                for s in g.slots:
                    s.job = None

    def _top_up(self) -> None:
        """Launch groups up to ``lookahead`` batches beyond the one the trainer takes next; (re)start any
        sample that has no job (after a resume)."""
        target = (self.consumed + 1 + self.lookahead) * self.per_batch
        while len(self.groups) + self.consumed * self.per_batch < target:
            position = self.sampler.position
            self.sampler.take(1)
            self.groups[position] = Group(position, self.sampler.task_at(position),
                                          [Slot() for _ in range(self.samples)])
        for g in self.groups.values():
            for i, s in enumerate(g.slots):
                if not s.settled and (s.job is None or s.job.done()):
                    self._launch(g, i)

    def _launch(self, group: Group, i: int) -> None:
        slot = group.slots[i]
        slot.result, slot.dropped = None, False
        slot.job = asyncio.get_running_loop().create_task(self._play(group, i), name=f"episode-{group.group_id}-{i}")

    async def _play(self, group: Group, i: int) -> None:
        """Run sample ``i`` of ``group`` until it has a result or is dropped; restarts preempted attempts."""
        assert self._sem is not None and self._changed is not None
        slot = group.slots[i]
        try:
            while not slot.settled:
                recorder = self.routing.episode() if self.routing is not None else None
                policy = EpisodePolicy(recorder or self.policy, (self.seed, group.position, i, slot.runs),
                                       epoch=lambda: self._epoch, version=lambda: self.engine.weight_version,
                                       max_staleness=self.max_staleness)
                try:
                    async with self._sem:
                        slot.result = await self.runner.run(group.task, policy, group.group_id)
                    if recorder is not None:
                        recorder.attach(slot.result)
                except Preempted:
                    self.counts["preempted"] += 1
                except StaleEpisode:
                    self._count_stale(slot)
                finally:
                    if recorder is not None:
                        recorder.discard()  # whatever ended the attempt, its calls are of no further use
                if not slot.settled:
                    slot.runs += 1
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug in an environment or harness: fail the step, never hang
            self._failure = e
        finally:
            self._changed.set()
        if self.on_episode_done is not None:
            self.on_episode_done()

    def _count_stale(self, slot: Slot) -> None:
        if self.stale == "drop":
            slot.dropped = True
            self.counts["stale_dropped"] += 1
        elif slot.recycles >= self.max_recycles:
            slot.dropped = True  # recycled max_recycles times and stale again: give up on it
            self.counts["stale_gave_up"] += 1
        else:
            slot.recycles += 1
            self.counts["stale_recycled"] += 1

    # -- picking a batch ------------------------------------------------------------------------------
    def _pick(self, version: int) -> list[Group] | None:
        if self._failure is not None:
            raise self._failure
        live = sorted(self.groups.values(), key=lambda g: g.position)
        candidates = [g for g in live if g.complete] if self.mode == "async" else live[: self.per_batch]
        for g in candidates:
            self._enforce_staleness(g, version)
        removed = [g for g in candidates if g.complete and (g.empty or not self._keep(g))]
        for g in removed:
            del self.groups[g.position]
            self.counts["groups_dropped" if g.empty else "groups_filtered"] += 1
        if removed:
            self._top_up()  # new tasks take the places of groups that lost every sample or were filtered
        ready = [g for g in candidates if g.complete and g.position in self.groups][: self.per_batch]
        if len(ready) < self.per_batch or (self.mode != "async" and len(ready) < len(candidates)):
            return None
        return ready

    def _keep(self, group: Group) -> bool:
        return group.empty or self.keep_group is None or self.keep_group(group.trajectories())

    def _enforce_staleness(self, group: Group, version: int) -> None:
        for i, slot in enumerate(group.slots):
            if slot.result and max(staleness(t, version) for t in slot.result) > self.max_staleness:
                slot.result = None
                self._count_stale(slot)
                if not slot.dropped:
                    slot.runs += 1
                    self._launch(group, i)

    async def _drain(self) -> None:
        """Wait until no episode is in flight."""
        assert self._changed is not None
        while True:
            if self._failure is not None:
                raise self._failure
            jobs = [s.job for g in self.groups.values() for s in g.slots if s.job is not None and not s.job.done()]
            if not jobs:
                return
            await asyncio.wait(jobs)

    def _batch_metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        """This batch's scheduling counters (staleness itself is reported by miles_agent.observe)."""
        mixed = sum(len(set(t.weight_versions)) > 1 for t in trajs)
        out = {**{k: float(v) for k, v in self.counts.items()}, "multi_version_samples": float(mixed)}
        if self.routing is not None:
            out["routing/missing"] = float(sum(bool(t.metadata.get("routing_missing")) for t in trajs))
            out["routing/stored_calls"] = float(self.routing.stored_calls)
        return out

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self, arrays: dict[str, Any] | None = None) -> dict[str, Any]:
        """Finished episodes in full, unfinished ones as (position, sample, attempts) to regenerate.
        With ``arrays``, R3 routing goes there (saved as a binary side file) instead of into the JSON."""
        return {
            "mode": self.mode, "position": self.sampler.position, "consumed": self.consumed,
            "counts": dict(self.counts),
            "groups": [{"position": g.position, "task_id": g.task.id,
                        "slots": [{"runs": s.runs, "recycles": s.recycles, "dropped": s.dropped,
                                   "result": None if s.result is None else [t.to_dict(arrays) for t in s.result]}
                                  for s in g.slots]}
                       for g in sorted(self.groups.values(), key=lambda g: g.position)],
        }

    def load_state_dict(self, state: dict[str, Any], arrays: Any = None) -> None:
        if state["mode"] != self.mode:
            raise UserError(f"--resume: the checkpoint was written in rollout.mode={state['mode']} but the "
                            f"config says {self.mode}; resume with rollout.mode={state['mode']}")
        self.sampler.position, self.consumed = state["position"], state["consumed"]
        self.counts.update(state["counts"])
        self.groups = {}
        for g in state["groups"]:
            task = self.sampler.task_at(g["position"])
            if task.id != g["task_id"]:
                raise UserError(f"--resume: task {g['position']} of the stream is {task.id!r} now but was "
                                f"{g['task_id']!r}; the task set changed since the checkpoint -- resume with "
                                "the same environment and tasks, or start a new run")
            slots = [Slot(runs=s["runs"], recycles=s["recycles"], dropped=s["dropped"],
                          result=None if s["result"] is None else [Trajectory.from_dict(t, arrays) for t in s["result"]])
                     for s in g["slots"]]
            self.groups[g["position"]] = Group(g["position"], task, slots)


def check_config(cfg: Any) -> None:
    """Reject scheduling settings that cannot work, naming the key and the fix."""
    if cfg.mode not in MODES:
        raise UserError(f"rollout.mode={cfg.mode!r} is not a mode; choose one of: {', '.join(MODES)}")
    if cfg.stale not in STALE_POLICIES:
        raise UserError(f"rollout.stale={cfg.stale!r}; choose recycle (re-run the episode) or drop")
    if cfg.partial_rollout not in PAUSE_MODES:
        raise UserError(f"rollout.partial_rollout={cfg.partial_rollout!r}; choose one of: {', '.join(PAUSE_MODES)}")
    if cfg.max_staleness < 0:
        raise UserError(f"rollout.max_staleness must be >= 0, got {cfg.max_staleness}")
    if cfg.max_recycles < 0:
        raise UserError(f"rollout.max_recycles={cfg.max_recycles} is negative; set it to 0 (drop a stale sample "
                        "at once) or more (how many times a stale sample is re-run before it is dropped)")
    if cfg.mode == "one_step_off" and cfg.max_staleness < 1:
        raise UserError("rollout.mode=one_step_off trains on samples one version old; set "
                        "rollout.max_staleness >= 1 or use rollout.mode=sync")
    if cfg.mode == "async" and cfg.max_staleness < 1:
        raise UserError("rollout.mode=async with max_staleness=0 can never overlap rollout and training; "
                        "set rollout.max_staleness >= 1 or use rollout.mode=sync")
