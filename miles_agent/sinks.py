"""Where per-step metric records go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

``run.sinks`` names the extra sinks, comma-separated (``"tensorboard"``, ``"wandb"``,
``"tensorboard,wandb"``). Every sink gets the same record (the schema in docs/metrics.md); the
JSONL file stays the source of truth that ``miles-agent report`` and ``--resume`` read, so an extra
sink failing to import fails the run at start, never half-way.

W&B honours its own environment variables: ``WANDB_MODE=offline`` writes the run under
``RUN_DIR/wandb/`` with no network (sync it later with ``wandb sync``).
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

from miles_agent.errors import UserError, require
from miles_agent.metrics import MetricsLog

EXTRA_SINKS = ("tensorboard", "wandb")


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def parse_sinks(text: str) -> list[str]:
    """``"tensorboard, wandb"`` -> ``["tensorboard", "wandb"]``; ``jsonl`` is implied and accepted."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*EXTRA_SINKS, "jsonl")]
    if unknown:
        raise UserError(f"run.sinks: unknown sink {unknown[0]!r}; choose from jsonl (always on), "
                        f"{', '.join(EXTRA_SINKS)}, comma-separated (e.g. run.sinks=tensorboard,wandb)")
    return [n for n in dict.fromkeys(names) if n != "jsonl"]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a record (booleans and non-numbers are left to the JSONL file)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TensorBoardSink:
    """One scalar per key, at global step ``record["step"]``, in ``RUN_DIR/tensorboard/``."""

    def __init__(self, run_dir: Path, resume: bool = False) -> None:
        require("tensorboard", "tensorboard", "run.sinks=tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tensorboard"
        if not resume:  # a fresh run in an old folder: its curves must not mix with the old run's
            shutil.rmtree(self.log_dir, ignore_errors=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            if math.isfinite(value):  # TensorBoard plots NaN as a gap at best; the JSONL keeps it
                self.writer.add_scalar(key, value, global_step=int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``RUN_DIR/wandb/``; its id is kept in ``RUN_DIR/wandb_id`` so ``--resume`` continues it."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any], resume: bool = False) -> None:
        self.wandb = require("wandb", "wandb", "run.sinks=wandb")
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = self.wandb.init(project=project, id=run_id, resume="allow", dir=str(run_dir),
                                   name=run_dir.resolve().name, config=config,
                                   settings=self.wandb.Settings(console="off", silent=True))

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class MetricSinks:
    """What the loop writes step records to: the JSONL log (also read back on resume) plus extras."""

    def __init__(self, run_dir: Path, extras: list[Sink] | None = None) -> None:
        self.jsonl = MetricsLog(run_dir)
        self.path = self.jsonl.path
        self.extras = list(extras or [])

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        for sink in self.extras:
            sink.write(record)

    def read(self) -> list[dict[str, Any]]:
        return self.jsonl.read()

    def close(self) -> None:
        for sink in self.extras:
            sink.close()
        self.extras = []


def build_sinks(run_dir: Path, sinks: str, config: dict[str, Any] | None = None,
                wandb_project: str = "miles-agent", resume: bool = False) -> MetricSinks:
    names = parse_sinks(sinks)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    extras: list[Sink] = []
    for name in names:
        if name == "tensorboard":
            extras.append(TensorBoardSink(run_dir, resume))
        elif name == "wandb":
            extras.append(WandbSink(run_dir, wandb_project, json.loads(json.dumps(config or {}, default=str)), resume))
    return MetricSinks(run_dir, extras)
