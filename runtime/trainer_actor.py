"""N trainer ranks as Ray actors, driven as one `Trainer`.

Each actor sets the torch.distributed env (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
from rank 0's node, ``LOCAL_RANK=0`` since Ray gives each actor its own visible GPUs) and builds the
configured trainer backend, which joins the group: gloo on CPU, NCCL on GPU. The driver calls every
method on all ranks (they are collectives), passes the batch once through the object store, and takes
rank 0's answer: its metrics, its logprob rows (every rank computes every row, in the caller's order, as
one process would), its gathered full weights for weight sync. Checkpoints are written by all ranks (DCP
shards) into the run folder, which must be shared when ranks sit on several nodes.

The group is the whole `miles_agent.trainer.Trainer` as the driver sees it: ``rank`` 0 (the driver
speaks for rank 0), ``device`` cpu (the driver computes nothing; what it hands back, the weights
included, are host tensors; each rank's own device is in ``rank_devices``), and ``on_micro_batch``
called once per step with rank 0's final (done, total) when the step returns (the ranks run in other
processes, so the live view sees the step's micro-batches at its end, not one by one).

A rank that dies ends the run with `RunAborted`: the last checkpoint is whole (checkpoints are
written to a temp folder and renamed), so ``--resume`` continues from it.

Offload (``train.offload``, on by default with ``cluster.colocate``): the ranks hold their device only
from a train step to the weight gather that follows it. Each rank offloads its parameters, gradients and
optimizer state to host memory right after it is built and right after every gather (the engines take
the device to generate), and reloads them when a call needs them: the logprob passes of the batch
builder and the train step (the driver starts either only after the engines released their memory), a
checkpoint save or load, ``save_hf``. The logprob passes keep the state resident for the train step
that follows them (it reports their reload); other calls offload again when they are done.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from miles_agent.errors import RunAborted
from miles_agent.trainer import TrainBatch
from miles_agent.types import Trajectory


class TrainerActor:
    """One rank. Plain class, wrapped with ``ray.remote`` by `RayTrainerGroup`."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.offload = False
        # (event, time.monotonic(), device bytes the trainer holds after it): offload / reload and the
        # calls between them, read back by `memory_log` (tests check the order; one clock per machine)
        self.events: deque[tuple[str, float, int]] = deque(maxlen=1000)
        self.broadcaster: Any = None  # weight sync from rank 0 (sync.transport=distributed), made on first use
        self.broadcaster_options: dict[str, Any] = {}
        self.staging: list[Any] = []  # host buffers reused by every pack of the full weights
        self.store_sender: Any = None  # rank 0's object-store pushes (runtime/store_push.py), made on first use
        self.engine_handles: dict[str, Any] = {}  # actor id -> handle, of the engines pushes went to
        self.pushed_version: int | None = None  # the weights are still this broadcast version (None: changed)
        self.reloaded: dict[str, float] | None = None  # a logprob pass's reload, reported by the next train step
        self.micro_batches = (0, 0)  # this step's (done, total), as the trainer reported it

    def address(self, loopback: bool) -> tuple[str, int]:
        """Rank 0 names the rendezvous: its node's address and a free port there."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, rank: int, world_size: int, master: tuple[str, int], backend: str, model: Any, tokenizer: Any,
              train_cfg: Any, algo_cfg: Any, temperature: float, device: str, extra: dict[str, Any],
              offload: bool = False) -> tuple[int, str]:
        import torch

        from miles_agent import registry

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))
        torch.set_num_threads(1)
        self.trainer = registry.load("trainers", backend)(model, tokenizer, train_cfg, algo_cfg,
                                                          temperature=temperature, device=device, **extra)
        self.offload = offload
        self._release()  # the engines generate first
        return os.getpid(), str(self.trainer.device)

    def train_step(self, batch: TrainBatch) -> tuple[dict[str, float], tuple[int, int]]:
        """The step's metrics and its micro-batches (done, total) as the trainer reported them."""
        moved = self._resident() or self.reloaded
        self.reloaded = self.pushed_version = None
        self.micro_batches = (0, 0)
        self.trainer.on_micro_batch = self._micro_batch_done
        try:
            metrics = self.trainer.train_step(batch)
        finally:
            self.trainer.on_micro_batch = None
        self._note("train_step")
        if moved:  # stays resident: the weight gather comes next
            metrics = {**metrics, "reload_s": moved["reload_s"], "offload_gib": moved["reload_bytes"] / 2**30}
        return metrics, self.micro_batches

    def _micro_batch_done(self, done: int, total: int) -> None:
        self.micro_batches = (done, total)

    def compute_logprobs(self, trajectories: list[Any], reference: bool) -> list[list[float]] | None:
        """A collective: every rank computes every row; rank 0 returns them, the others None. The state
        stays resident: the batch builder calls this right before the train step."""
        moved = self._resident()
        if moved:
            self.reloaded = moved
        rows = self.trainer.compute_logprobs(trajectories, reference=reference)
        self._note("compute_logprobs")
        return rows if self.trainer.rank == 0 else None

    def full_weights(self) -> Any:
        """A collective: every rank gathers; rank 0 returns a host copy (`PackedWeights`), the others None.
        Then the device goes back to the engines (they load these weights next)."""
        from miles_agent.runtime.packed_weights import pack_weights

        with self._gathering() as rank0:
            return pack_weights(self.trainer.named_weights(), self.staging) if rank0 else None

    def put_to_engines(self, engines: list[Any], version: int, bucket_bytes: int, shared_memory: bool = True) -> Any:
        """A collective: every rank gathers; rank 0 sends the weights to every engine actor bucket by bucket
        (``bucket_bytes``), through shared memory when they are all on its node (``shared_memory``), else
        through ``ray.put`` (runtime/store_push.py). ``engines``: actor handles, or the ids of those sent
        before (`known_engines`). Rank 0 returns ``[handles, stats, pending]`` once everything is sent: the
        driver keeps the handles for engines that restart (it never reads the bytes) and waits for the loads
        (`PendingLoads.wait`); the others return None."""
        from miles_agent.runtime.store_push import StorePush, StoreSender, pipelines

        started = time.perf_counter()
        engines = self.known_engines(engines)
        if self.trainer.rank == 0 and self.store_sender is None:
            self.store_sender = StoreSender()
        shared = bool(shared_memory and self.trainer.rank == 0 and self.store_sender.shared_memory_reaches(engines))
        with self._gathering() as rank0:
            if not rank0:
                return None
            push = StorePush(self.store_sender, engines, version, bucket_bytes)
            push.write(self.trainer.named_weights(), shared=shared, staging=self.staging,
                       dispatch=pipelines(str(getattr(self.trainer, "device", "cpu")), colocated=self.offload),
                       announce=not self.offload)
        handles, stats, pending = push.finish()
        return [handles, {**stats, "sync_rank0_s": time.perf_counter() - started}, pending]

    def known_engines(self, engines: list[Any]) -> list[Any]:
        """Engine actor handles from handles or the ids of handles sent before: an actor handle costs its
        receiver ~0.5 ms to take in, on every push otherwise."""
        out = []
        for e in engines:
            if isinstance(e, str):
                out.append(self.engine_handles[e])
            else:
                out.append(self.engine_handles.setdefault(e._actor_id.hex(), e))
        return out

    def broadcast_weights(self, engines: list[Any], version: int, options: dict[str, Any]) -> Any:
        """A collective: every rank gathers; rank 0 broadcasts to ``engines`` (engine actors or SGLang URLs)
        and returns the stats -- see miles_agent.runtime.rank0_sync."""
        with self._gathering() as rank0:
            if not rank0:
                return None
            if self.broadcaster is None or self.broadcaster_options != options:
                from miles_agent.runtime.rank0_sync import Rank0Broadcaster

                if self.broadcaster is not None:
                    self.broadcaster.close()
                self.broadcaster, self.broadcaster_options = Rank0Broadcaster(**options), options
            out = self.broadcaster.push(self.trainer.named_weights(), engines, version)
            self.pushed_version = version
            return out

    def resync(self, engines: list[Any], options: dict[str, Any]) -> int | None:
        """A collective (when it sends): bring replaced ``engines`` to the weights last broadcast, if no train
        step has changed them since; returns that version, or None (they wait for the next push)."""
        version = self.pushed_version
        if version is None:
            return None
        with self._gathering() as rank0:
            if rank0:
                self.broadcaster.send_once(self.trainer.named_weights(), engines, version)
            return version

    def save_checkpoint(self, path: str) -> None:
        self._resident()
        self.trainer.save_checkpoint(Path(path))
        self._note("save_checkpoint")
        self._release()

    def load_checkpoint(self, path: str) -> None:
        self._resident()
        self.pushed_version = None
        self.trainer.load_checkpoint(Path(path))
        self._note("load_checkpoint")
        self._release()

    def save_hf(self, path: str) -> None:
        self._resident()
        self.trainer.save_hf(Path(path))
        self._note("save_hf")
        self._release()

    @contextlib.contextmanager
    def _gathering(self) -> Iterator[bool]:
        """Around a read of the full weights (a collective): the state made resident first, the device
        given back after. Yields whether this is rank 0, which reads them; the other ranks have already
        taken their part in the gather."""
        self._resident()
        try:
            if self.trainer.rank != 0:
                for _ in self.trainer.named_weights():
                    pass
            yield self.trainer.rank == 0
        finally:
            self._note("gather")
            self._release()

    # -- offload (see the module docstring) ------------------------------------------------------------
    def _resident(self) -> dict[str, float] | None:
        """The trainer's state on its device; the reload's figures when it had to move."""
        if not (self.offload and self.trainer.memory.offloaded):
            return None
        moved = self.trainer.reload()
        self._note("reload")
        return moved

    def _release(self) -> None:
        if self.offload:
            self.trainer.offload()
            self._note("offload")

    def _note(self, event: str) -> None:
        if self.offload:
            self.events.append((event, time.monotonic(), self.trainer.memory.resident_bytes()))

    def memory_log(self) -> list[tuple[str, float, int]]:
        return list(self.events)

    def close(self) -> None:
        if self.store_sender is not None:
            self.store_sender.close()
        if self.trainer is not None and hasattr(self.trainer, "close"):
            self.trainer.close()

    def where(self) -> dict[str, Any]:
        from miles_agent.runtime.ray_cluster import where_am_i

        return where_am_i()

    def crash(self) -> None:
        os._exit(1)


class RayTrainerGroup:
    """The `Trainer` contract over ``world_size`` rank actors (see module docstring).

    ``options(rank)`` gives each actor's Ray options (placement); ``before_train`` runs once before each
    step's first call that computes on the ranks, a logprob pass or the train step (colocation: the
    engines release the device, then the ranks reload); ``offload`` makes the ranks give their device
    back between steps (see the module docstring); ``on_close`` runs after the ranks are gone."""

    def __init__(self, model: Any, tokenizer: Any, train_cfg: Any, algo_cfg: Any, *, temperature: float,
                 device: str, options: Callable[[int], dict[str, Any]], loopback: bool = True,
                 before_train: Callable[[], None] | None = None, extra: dict[str, Any] | None = None,
                 offload: bool = False, on_close: Callable[[], None] | None = None) -> None:
        import ray
        import torch

        n = train_cfg.world_size
        cls = ray.remote(max_restarts=0)(TrainerActor)
        self.actors = [cls.options(**options(r)).remote() for r in range(n)]
        self.before_train, self.on_close = before_train, on_close
        self.rank = 0  # the driver speaks for rank 0
        self._engines_sent: set[str] = set()  # engine actor ids whose handles the ranks have (put_to_engines)
        self.device = torch.device("cpu")  # the driver's side: host tensors only (see the module docstring)
        self.on_micro_batch: Callable[[int, int], None] | None = None
        self._submit = threading.Lock()
        self._prepared = False  # before_train has run, and only logprob passes since
        self._closed = False
        master = self._all([self.actors[0].address.remote(loopback)])[0]
        model_ref, tok_ref = ray.put(model.to("cpu")), ray.put(tokenizer)
        ranks = self._all([a.setup.remote(r, n, master, train_cfg.backend, model_ref, tok_ref, train_cfg,
                                          algo_cfg, temperature, device, extra or {}, offload)
                           for r, a in enumerate(self.actors)])
        self.pids = [pid for pid, _ in ranks]
        self.rank_devices = [torch.device(d) for _, d in ranks]  # each as its own process names it

    def _on_ranks(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank and wait. Submitted under a lock: two driver threads (the step in
        a worker thread, an engine resync on the event loop) must reach every rank in the same order, or
        the ranks would enter different collectives."""
        with self._submit:
            refs = [getattr(a, method).remote(*args) for a in self.actors]
            # prepared stays true only from a logprob pass to the next call (the train step, normally)
            self._prepared = self._prepared and method == "compute_logprobs"
        return self._all(refs)

    def _all(self, refs: list[Any]) -> list[Any]:
        """Every rank's answer, in rank order. Results are taken as they come, so one dead rank ends
        the wait at once instead of leaving the driver on a survivor blocked in a collective."""
        import ray

        from miles_agent.runtime.supervisor import actor_failures

        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(refs)
        except actor_failures() as e:
            self._kill()
            raise RunAborted(f"a trainer rank died ({type(e).__name__}: {str(e).splitlines()[0][:200]}); the last "
                             "checkpoint in <run_dir>/checkpoints is whole: rerun with --resume to continue") from None

    def _prepare(self) -> None:
        if self.before_train is not None and not self._prepared:
            self.before_train()
        self._prepared = True

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        import ray

        self._prepare()
        metrics, (done, total) = self._on_ranks("train_step", ray.put(batch))[0]
        if self.on_micro_batch is not None and total:
            self.on_micro_batch(done, total)
        return metrics

    def compute_logprobs(self, trajectories: Sequence[Trajectory], reference: bool = False) -> list[list[float]]:
        """Rank 0's rows: one per trajectory, in order, as one process computes them (every rank computes
        all of them; the trajectories go to the ranks once through the object store)."""
        import ray

        self._prepare()
        return self._on_ranks("compute_logprobs", ray.put(list(trajectories)), reference)[0]

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """Lazy: the ranks gather (and, with offload, free their device) when the first tensor is read, so
        a transport that never reads them (rank 0 broadcasting itself) costs no gather here."""
        from miles_agent.runtime.packed_weights import named_tensors

        yield from named_tensors(self._on_ranks("full_weights")[0])

    def put_to_engines(self, engine_actors: list[Any], version: int, bucket_bytes: int, shared_memory: bool = True
                       ) -> tuple[list[Any], dict[str, float]]:
        """Rank 0 sends the weights to ``engine_actors`` bucket by bucket (see `TrainerActor.put_to_engines`),
        and this waits until every engine has loaded them: (handles of the buckets, the push's stats). The
        driver never reads the bytes; it keeps the handles for engines that restart. Each engine's handle
        crosses to the ranks once; later pushes name it by id."""
        ids = [a._actor_id.hex() for a in engine_actors]
        sent = [i if i in self._engines_sent else a for i, a in zip(ids, engine_actors)]
        handles, stats, pending = self._on_ranks("put_to_engines", sent, version, bucket_bytes, shared_memory)[0]
        self._engines_sent.update(ids)
        return handles, {**stats, **pending.wait()}

    def broadcast_weights(self, engine_actors: list[Any], version: int, options: dict[str, Any]
                          ) -> dict[str, float]:
        """Rank 0 sends the weights to ``engine_actors`` itself (``options``: `Rank0Broadcaster`'s)."""
        return self._on_ranks("broadcast_weights", engine_actors, version, options)[0]

    def resync(self, engine_actors: list[Any], options: dict[str, Any]) -> int | None:
        """Rank 0 sends its weights to replaced engines now, if they are still the last pushed version:
        returns that version, or None when a train step has changed them since (the engines then join
        the next push)."""
        return self._on_ranks("resync", engine_actors, options)[0]

    def save_checkpoint(self, path: Path) -> None:
        self._on_ranks("save_checkpoint", str(path))

    def load_checkpoint(self, path: Path) -> None:
        self._on_ranks("load_checkpoint", str(path))

    def save_hf(self, path: Path) -> None:
        self._on_ranks("save_hf", str(path))

    def where(self) -> list[dict[str, Any]]:
        return self._on_ranks("where")

    def memory_log(self) -> list[list[tuple[str, float, int]]]:
        """Per rank: (event, monotonic time, device bytes held after it) for offload, reload and the calls."""
        return self._on_ranks("memory_log")

    def close(self) -> None:
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=30)
            except Exception:  # noqa: BLE001 - closing after a failure: the actors go anyway
                pass
            self._kill()
        finally:
            if self.on_close is not None:
                self.on_close()

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
