"""The driver loop: generate, train, sync weights -- read it top to bottom.

    for each step:
        batch = scheduler.next_batch()                    # whole groups of TITO trajectories, version per span
        advantages = estimator(rewards, groups)           # per token
        trainer.train_step(trajectories, advantages)      # in a thread: async modes keep generating meanwhile
        with scheduler.weight_update():                   # one-step-off: batch in flight ends; async: pause
            transport.push(trainer weights -> engine, version = step + 1)
        checkpoint every N steps                          # trainer + scheduler buffer + RNG, atomically

How episodes overlap training (sync | one_step_off | async, staleness, partial rollouts) lives in
miles_agent/scheduling.py. Everything here runs on the embedded defaults in one process; the same loop
drives Ray actors later.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from miles_agent import plugins, run_state
from miles_agent.build import build_env, build_harness, check_choices, env_sandboxes
from miles_agent.config import Config
from miles_agent.dumps import RolloutRecorder
from miles_agent.environment import split_tasks
from miles_agent.errors import RunAborted, UserError
from miles_agent.metrics import rollout_metrics, summary_line
from miles_agent.observe import StepObserver
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.rollout.routing_capture import RoutingCapture
from miles_agent.run_state import capture_rng, latest_checkpoint, restore_rng, write_checkpoint
from miles_agent.scheduling import RolloutScheduler, TaskSampler
from miles_agent.sinks import build_sinks
from miles_agent.types import Status

ROUTING_FILE = "routing.npz"  # R3 routing of the episodes a checkpoint buffers (miles_agent.scheduling)
EVAL_FILE = "eval.jsonl"  # run.eval_every's rows


class Run:
    """One training run: the parts, the loop, and checkpoint/resume of the loop's own state."""

    def __init__(self, cfg: Config, resume: bool = False) -> None:
        import torch

        from miles_agent.algorithms.batch_builder import BatchBuilder
        from miles_agent.components import build_critic, cluster_for
        from miles_agent.models.loading import load_policy
        from miles_agent.teacher import build_distiller

        check_choices(cfg)  # a bad name fails before any work
        self.cfg = cfg
        self.run_dir = Path(cfg.run.run_dir)
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        self.env = build_env(cfg)
        make_sandbox = env_sandboxes(cfg, self.env)  # sandbox options checked before the model loads
        self.eval_tasks = eval_tasks(cfg, self.env)  # run.eval_every: the env's eval split, checked now
        model, self.tokenizer = load_policy(cfg, self.env)
        engine_model = copy.deepcopy(model)  # before the trainer shards its own copy
        critic = build_critic(cfg, model, self.tokenizer)  # copies the policy before the trainer shards it
        self.cluster = cluster_for(cfg)  # cluster.mode: where the trainer, engines and transport live
        self.trainer = self.cluster.trainer(model, self.tokenizer)
        self.batches = BatchBuilder(cfg.algo, self.trainer, critic)  # advantages (and the critic's step)
        self.engines = self.cluster.engines(engine_model, self.tokenizer)
        self.engine = self.engines[0]  # episodes go through this client (a router when there are several)
        self.transport = self.cluster.transport(self.trainer, self.engines)
        self.runner = EpisodeRunner(plugins.with_reward(self.env, cfg.env.reward),  # env.reward: user code
                                    build_harness(cfg, self.env, self.tokenizer), make_sandbox=make_sandbox,
                                    reward_out_of_range=cfg.env.reward_out_of_range)
        self.sampler = TaskSampler(split_tasks(self.env, "train", None), cfg.run.seed)
        self.tasks_by_id = {t.id: t for t in self.sampler.tasks}
        # R3: each episode calls the engine through a recorder of routed experts, attached to it as it ends
        self.routing = RoutingCapture(self.engine) if cfg.algo.routing_replay else None
        self.scheduler = RolloutScheduler(self.runner, self.sampler, self.engine, self.engines, cfg.rollout,
                                          seed=cfg.run.seed, routing=self.routing)
        self.group_filter = None
        if cfg.algo.dynamic_sampling or cfg.rollout.group_filter:  # DAPO / a user's: rejected groups are replaced
            from miles_agent.algorithms.dynamic_sampling import InformativeGroupFilter, is_informative

            user = cfg.rollout.group_filter and plugins.load("rollout.group_filter", cfg.rollout.group_filter)
            checks = [f for f in (cfg.algo.dynamic_sampling and is_informative, user) if f]
            self.group_filter = InformativeGroupFilter(cfg.rollout.prompts_per_step,
                                                       cfg.algo.dynamic_sampling_max_rounds,
                                                       predicate=lambda g: all(f(g) for f in checks))
            self.scheduler.keep_group = self.group_filter
        self.distiller = build_distiller(cfg, self.env, self.tokenizer, self.engine)  # None unless a teacher is set
        builtin_sinks = plugins.split_sinks(cfg.run.sinks)[0]  # and module:Class sinks, a user's
        self.metrics = build_sinks(self.run_dir, builtin_sinks, cfg.to_dict(), cfg.run.wandb_project, resume)
        self.metrics.extras += plugins.user_sinks(cfg.run.sinks, self.run_dir, cfg.to_dict(), resume)
        self.hooks = plugins.Hooks(cfg.run.hooks)
        self.step = 0
        self._resync_version: int | None = None
        if resume:
            self._resume()
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            self.metrics.path.unlink(missing_ok=True)
            (self.run_dir / EVAL_FILE).unlink(missing_ok=True)
        self.observer = StepObserver(self.runner, self.engines)  # after resume: counters' deltas start here
        self.recorder = RolloutRecorder(self.run_dir, cfg.run.dump_rollouts, cfg.run.log_samples, self.step)

    async def train(self, progress: Any = None) -> list[dict[str, Any]]:
        """rollout (scheduler) -> advantages -> train step -> weight push; in one_step_off / async mode the
        scheduler keeps generating while the trainer works (in a thread), see miles_agent.scheduling."""
        cfg, records = self.cfg, []
        if progress and hasattr(self.trainer, "on_micro_batch"):
            self.trainer.on_micro_batch = progress.micro_batch_done
        if self._resync_version is not None:
            await self.transport.push(self.trainer.named_weights(), version=self._resync_version)
            self._resync_version = None
        self.scheduler.on_episode_done = progress.episode_done if progress else None
        stop = run_state.StopSignals()  # SIGINT / SIGTERM: the step in progress ends, is saved, and the run stops
        self.hooks.pending.update(await self.hooks.fire("on_run_start", self))  # logged with the first step
        try:
            while self.step < cfg.run.steps:
                record: dict[str, Any] = {"step": self.step, "weight_version": self.engine.weight_version}
                if progress:
                    progress.phase("rollout", total=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt)
                t0 = time.perf_counter()
                if cfg.rollout.function:  # user code generates this step's episodes (sync mode)
                    trajs, sched_metrics = await plugins.RolloutContext(
                        self.step, self.sampler.take(cfg.rollout.prompts_per_step), cfg.rollout.samples_per_prompt,
                        self.engine, self.runner, self.tokenizer, cfg).run(cfg.rollout.function), {}
                else:
                    trajs, sched_metrics = await self.scheduler.next_batch(version=self.step)
                # env.group_reward, env.reward_post: user code rewrites the batch's rewards
                await plugins.batch_rewards(cfg, trajs, self.tasks_by_id, self.tokenizer)
                record.update(await self.hooks.fire("after_rollout", self.step, trajs))
                t1 = time.perf_counter()
                trainable = [t.validate() for t in trajs if t.status in (Status.COMPLETED, Status.TRUNCATED)]
                if cfg.rollout.buffer_filter:  # user code picks what trains (whole groups, by its own rule)
                    trainable = plugins.load("rollout.buffer_filter", cfg.rollout.buffer_filter)(trainable)
                    record["buffer_filter/kept"] = float(len(trainable))
                if not trainable:
                    raise RunAborted(f"step {self.step}: every episode failed ({self.runner.stats.errors[-3:]}); "
                                     "nothing to train on")
                record.update(rollout_metrics(trajs))
                record.update(plugins.env_metrics(self.env, trajs))  # env.mix: per-env reward, pass rate
                record.update(sched_metrics)
                record.update(self.runner.stats.as_metrics())  # infra retries / aborted, task failures
                record.update(self.observer.rollout_record(trajs, trainer_version=self.step))
                if progress:
                    progress.phase("train")
                if self.group_filter is not None:
                    record.update(self.group_filter.step_metrics())
                batch, algo_metrics = self.batches.build(trainable)  # advantages; a critic steps here
                record.update(algo_metrics)
                if self.distiller is not None:  # teacher logprobs on the sampled tokens (miles_agent/teacher.py)
                    batch, distill_metrics = await self.distiller.apply(batch)
                    record.update(distill_metrics)
                self.recorder.record(self.step, trajs, batch.trajectories, batch.advantages)
                record.update(await self.hooks.fire("before_train_step", self.step, batch))
                train_metrics = await self._train_step(batch)
                record.update(await self.hooks.fire("after_train_step", self.step, train_metrics))
                t2 = time.perf_counter()
                if progress:
                    progress.phase("sync")
                weights = progress.track_sync(self.trainer.named_weights()) if progress else self.trainer.named_weights()
                async with self.scheduler.weight_update():
                    sync = await self.transport.push(weights, version=self.step + 1)
                t3 = time.perf_counter()
                record.update(await self.hooks.fire("after_weight_sync", self.step, self.step + 1))
                record.update({f"train/{k}": v for k, v in train_metrics.items()})
                if cfg.rollout.weight_format != "auto":  # the mismatch under the rollout's precision
                    record[f"mismatch/{cfg.rollout.weight_format}"] = train_metrics.get("logprob_mismatch_mean", 0.0)
                record.update(sync)
                record.update({"time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2,
                               "time/step": t3 - t0,
                               "rollout_tokens_per_s": record["sampled_tokens"] / max(t1 - t0, 1e-9)})
                self.step += 1
                if cfg.run.eval_every and self.step % cfg.run.eval_every == 0:
                    record.update(await self._evaluate(progress))
                self.metrics.write(record)
                records.append(record)
                if progress:
                    progress.step_done(record, summary_line(record))
                every = cfg.run.checkpoint_every
                if (every and self.step % every == 0) or self.step == cfg.run.steps or stop.requested:
                    path = self.save_checkpoint()
                    self.hooks.pending.update(await self.hooks.fire("on_checkpoint", self.step, path))
                if stop.requested and self.step < cfg.run.steps:
                    raise run_state.Interrupted(self.step, path)
        finally:
            stop.remove()
            await self.scheduler.close()
        self.trainer.save_hf(self.run_dir / "final")
        if final := await self.hooks.fire("on_run_end", self, records):  # no step row left to log them in
            (self.run_dir / "hooks_final.json").write_text(json.dumps(final, indent=2))
        return records

    async def _evaluate(self, progress: Any) -> dict[str, float]:
        """The current policy (the weights just pushed) on the eval split, as ``eval/*`` metrics."""
        from miles_agent.rollout.episodes import collect

        if progress:
            progress.phase("eval")
        t0 = time.perf_counter()
        runner = EpisodeRunner(plugins.with_reward(self.env, self.cfg.env.reward),
                               build_harness(self.cfg, self.env, self.tokenizer),
                               make_sandbox=env_sandboxes(self.cfg, self.env))
        trajs = await collect(runner, self.eval_tasks, 1, self.engine, self.cfg.rollout.concurrency)
        metrics = {**rollout_metrics(trajs), **plugins.env_metrics(self.env, trajs)}
        row = {"step": self.step - 1, "weight_version": self.step, "split": "eval", **metrics}  # beside metrics.jsonl
        with (self.run_dir / EVAL_FILE).open("a") as f:
            f.write(json.dumps(row) + "\n")
        return {**{f"eval/{k}": v for k, v in metrics.items()}, "time/eval": time.perf_counter() - t0}

    async def _train_step(self, batch: Any) -> dict[str, float]:
        """In sync mode inline; otherwise in a worker thread, so episodes keep running on the event loop."""
        if self.cfg.rollout.mode == "sync":
            return self.trainer.train_step(batch)
        device = getattr(self.trainer, "device", None)

        def step() -> dict[str, float]:
            if getattr(device, "type", None) == "cuda":  # the current CUDA device is per thread
                import torch

                torch.cuda.set_device(device)
            return self.trainer.train_step(batch)

        return await asyncio.to_thread(step)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Trainer state + loop state (scheduler buffer, RNG) in ``checkpoints/step_N``, atomically."""
        counters = {k: v for k, v in vars(self.runner.stats).items() if isinstance(v, int)}
        arrays: dict[str, Any] = {}  # R3 routing of buffered episodes: a binary file, not JSON
        state = {"step": self.step, "weight_version": self.engine.weight_version, "episode_stats": counters,
                 "scheduler": self.scheduler.state_dict(arrays), "rng": capture_rng()}

        def save_trainer(path: Path) -> None:
            self.trainer.save_checkpoint(path)
            self.batches.save_checkpoint(path.parent)  # the critic, when there is one
            if arrays:
                np.savez(path.parent / ROUTING_FILE, **arrays)

        return write_checkpoint(self.run_dir / "checkpoints", self.step, save_trainer, state)

    def _resume(self) -> None:
        path, state = latest_checkpoint(self.run_dir / "checkpoints")
        self.trainer.load_checkpoint(path / "trainer")
        self.batches.load_checkpoint(path)
        self.step = state["step"]
        for name, value in state["episode_stats"].items():  # cumulative counters continue
            setattr(self.runner.stats, name, value)
        routing = path / ROUTING_FILE
        with np.load(routing) if routing.is_file() else contextlib.nullcontext() as arrays:
            self.scheduler.load_state_dict(state["scheduler"], arrays)
        restore_rng(state["rng"])
        self._resync_version = state["weight_version"]  # pushed to the engine when the loop starts
        # Steps logged after the checkpoint are redone: drop them from the log.
        kept = [r for r in self.metrics.read() if r["step"] < self.step]
        tmp = self.metrics.path.with_name(self.metrics.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.metrics.path)
        evals = self.run_dir / EVAL_FILE
        if evals.is_file():  # and the evaluations of those steps
            rows = [line for line in evals.read_text().splitlines() if json.loads(line)["step"] < self.step]
            evals.write_text("".join(r + "\n" for r in rows))


def eval_tasks(cfg: Config, env: Any) -> list[Any]:
    """The tasks ``run.eval_every`` plays (none when it is 0); an env without an eval split fails here."""
    if cfg.run.eval_every < 0:
        raise UserError(f"run.eval_every must be >= 0 (0 = never), got {cfg.run.eval_every}")
    if not cfg.run.eval_every:
        return []
    try:
        return env.tasks("eval")
    except ValueError as e:
        raise UserError(f"run.eval_every={cfg.run.eval_every} plays the environment's eval split, which "
                        f"{env.name!r} does not have ({e}); set run.eval_every=0") from None


def train(cfg: Config, resume: bool = False, progress: Callable[[Run], Any] | None = None) -> list[dict[str, Any]]:
    """Build a run and train it; returns the per-step metric records. ``progress(run)`` makes the live
    view once the run is built (so bad input fails before any bar is drawn)."""
    if cfg.algo.loss == "sft":  # supervised: a dataset of trajectories instead of rollouts
        from miles_agent.sft_run import train_sft

        return train_sft(cfg, resume=resume, progress=progress)
    run = Run(cfg, resume=resume)
    view = progress(run) if progress else None

    async def main() -> list[dict[str, Any]]:
        try:
            return await run.train(view)
        finally:
            for engine in run.engines:
                await engine.shutdown()
            if run.distiller is not None:
                await run.distiller.shutdown()
            if hasattr(run.trainer, "close"):
                run.trainer.close()
            run.batches.close()
            run.metrics.close()
            if view is not None:
                view.close()

    return asyncio.run(main())
