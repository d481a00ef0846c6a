"""N trainer ranks as Ray actors, driven as one `Trainer`.

Each actor sets the torch.distributed env (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
from rank 0's node, ``LOCAL_RANK=0`` since Ray gives each actor its own visible GPUs) and builds the
configured trainer backend, which joins the group: gloo on CPU, NCCL on GPU. The driver calls every
method on all ranks (they are collectives), passes the batch once through the object store, and takes
rank 0's answer: its metrics, its gathered full weights for weight sync. Checkpoints are written by
all ranks (DCP shards) into the run folder, which must be shared when ranks sit on several nodes.

A rank that dies ends the run with `RunAborted`: the last checkpoint is whole (checkpoints are
written to a temp folder and renamed), so ``--resume`` continues from it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from miles_agent.errors import RunAborted
from miles_agent.trainer import TrainBatch


class TrainerActor:
    """One rank. Plain class, wrapped with ``ray.remote`` by `RayTrainerGroup`."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.broadcaster: Any = None  # weight sync from rank 0 (sync.transport=distributed), made on first use

    def address(self, loopback: bool) -> tuple[str, int]:
        """Rank 0 names the rendezvous: its node's address and a free port there."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, rank: int, world_size: int, master: tuple[str, int], backend: str, model: Any, tokenizer: Any,
              train_cfg: Any, algo_cfg: Any, temperature: float, device: str, extra: dict[str, Any]) -> int:
        import torch

        from miles_agent import registry

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))
        torch.set_num_threads(1)
        self.trainer = registry.load("trainers", backend)(model, tokenizer, train_cfg, algo_cfg,
                                                          temperature=temperature, device=device, **extra)
        return os.getpid()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def full_weights(self) -> list[tuple[str, Any]] | None:
        """A collective: every rank gathers; rank 0 returns host copies, the others None."""
        out = [(n, t.detach().to("cpu", copy=True)) for n, t in self.trainer.named_weights()]
        return out if self.trainer.rank == 0 else None

    def broadcast_weights(self, actors: list[Any], version: int, options: dict[str, Any]) -> Any:
        """A collective: every rank gathers; rank 0 broadcasts to the engine ``actors`` and returns (stats,
        object ref of a host copy) -- see miles_agent.runtime.rank0_sync."""
        if self.trainer.rank != 0:
            for _ in self.trainer.named_weights():
                pass
            return None
        if self.broadcaster is None:
            from miles_agent.runtime.rank0_sync import Rank0Broadcaster

            self.broadcaster = Rank0Broadcaster(**options)
        return self.broadcaster.push(self.trainer.named_weights(), actors, version)

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(Path(path))

    def save_hf(self, path: str) -> None:
        self.trainer.save_hf(Path(path))

    def close(self) -> None:
        if self.trainer is not None and hasattr(self.trainer, "close"):
            self.trainer.close()

    def where(self) -> dict[str, Any]:
        from miles_agent.runtime.ray_cluster import where_am_i

        return where_am_i()

    def crash(self) -> None:
        os._exit(1)


class RayTrainerGroup:
    """The `Trainer` contract over ``world_size`` rank actors (see module docstring).

    ``options(rank)`` gives each actor's Ray options (placement); ``before_train`` runs before every
    step (colocation: the engines release the device)."""

    def __init__(self, model: Any, tokenizer: Any, train_cfg: Any, algo_cfg: Any, *, temperature: float,
                 device: str, options: Callable[[int], dict[str, Any]], loopback: bool = True,
                 before_train: Callable[[], None] | None = None, extra: dict[str, Any] | None = None) -> None:
        import ray

        n = train_cfg.world_size
        cls = ray.remote(max_restarts=0)(TrainerActor)
        self.actors = [cls.options(**options(r)).remote() for r in range(n)]
        self.before_train = before_train
        self.rank = 0
        master = self._all([self.actors[0].address.remote(loopback)])[0]
        model_ref, tok_ref = ray.put(model.to("cpu")), ray.put(tokenizer)
        self.pids = self._all([a.setup.remote(r, n, master, train_cfg.backend, model_ref, tok_ref, train_cfg,
                                              algo_cfg, temperature, device, extra or {})
                                   for r, a in enumerate(self.actors)])

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

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        import ray

        if self.before_train is not None:
            self.before_train()
        ref = ray.put(batch)
        return self._all([a.train_step.remote(ref) for a in self.actors])[0]

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        yield from self._all([a.full_weights.remote() for a in self.actors])[0]

    def broadcast_weights(self, engine_actors: list[Any], version: int, options: dict[str, Any]
                          ) -> tuple[dict[str, float], Any]:
        """Rank 0 sends the weights to ``engine_actors`` itself (``options``: `Rank0Broadcaster`'s)."""
        return self._all([a.broadcast_weights.remote(engine_actors, version, options) for a in self.actors])[0]

    def save_checkpoint(self, path: Path) -> None:
        self._all([a.save_checkpoint.remote(str(path)) for a in self.actors])

    def load_checkpoint(self, path: Path) -> None:
        self._all([a.load_checkpoint.remote(str(path)) for a in self.actors])

    def save_hf(self, path: Path) -> None:
        self._all([a.save_hf.remote(str(path)) for a in self.actors])

    def where(self) -> list[dict[str, Any]]:
        return self._all([a.where.remote() for a in self.actors])

    def close(self) -> None:
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - closing after a failure: the actors go anyway
            pass
        self._kill()

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
