"""The driver's own checkpoint: loop state and RNG states, beside the trainer's, written atomically.

Layout of ``<run_dir>/checkpoints``::

    step_N/trainer/          the trainer's checkpoint (model, optimizer, its per-rank RNG)
    step_N/loop_state.json   step, weight version, episode counters, the scheduler's buffer,
                             python / numpy / torch RNG states
    step_N/manifest.json     size and sha256 of every file above, written last
    latest                   the name of the newest complete step_N folder

``step_N`` is built as ``step_N.tmp`` and renamed into place, then ``latest`` is rewritten by rename,
so a crash at any moment leaves ``latest`` naming a whole checkpoint (NeMo-RL #3599). The rollout
A resume checks the manifest and falls back to the newest intact step (a truncated shard, a torn JSON
file, ``latest`` naming a step that is gone), saying which and why. The rollout
engine's sampling RNG is not saved because it holds none worth saving: every request's seed is derived
from its place in the task stream (see `miles_agent.rollout.episode_policy`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from miles_agent.atomic import replace_dir
from miles_agent.errors import UserError

LOOP_STATE = "loop_state.json"
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    import torch

    version, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [version, keys.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state().tolist()}


def restore_rng(state: dict[str, Any]) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    v, keys, pos, has_gauss, g = state["numpy"]
    np.random.set_state((v, np.asarray(keys, dtype=np.uint32), pos, has_gauss, g))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def write_checkpoint(ckpt_root: Path, step: int, save_trainer: Any, loop_state: dict[str, Any]) -> Path:
    """``save_trainer(path)`` writes the trainer's part; the loop state goes beside it; all atomic."""
    path = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_trainer(tmp / "trainer")
    (tmp / LOOP_STATE).write_text(json.dumps(loop_state))
    files = {str(f.relative_to(tmp)): _digest(f, sync=True) for f in sorted(tmp.rglob("*")) if f.is_file()}
    (tmp / MANIFEST).write_text(json.dumps(files))
    replace_dir(tmp, path)
    latest_tmp = ckpt_root / "latest.tmp"
    latest_tmp.write_text(path.name)
    latest_tmp.rename(ckpt_root / "latest")
    return path


def _digest(path: Path, sync: bool = False) -> list[Any]:
    """[size, sha256] of a file; ``sync``: flushed to disk too, so a power cut cannot leave it empty."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return [path.stat().st_size, h.hexdigest()]


def check_checkpoint(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None when it is whole."""
    if not path.is_dir():
        return "missing"
    for name in (LOOP_STATE, MANIFEST):
        if name == MANIFEST and not (path / name).exists():
            return None  # written before manifests: nothing more to check
        try:
            files = json.loads((path / name).read_text())
        except FileNotFoundError:
            return f"no {name}"
        except (ValueError, UnicodeDecodeError):
            return f"{name} is truncated or corrupt"
    for name, (size, sha) in files.items():
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have != size:
            return f"{name} is {'missing' if have is None else f'truncated ({have} of {size} bytes)'}"
        if _digest(path / name)[1] != sha:
            return f"{name} is corrupt (its checksum differs from the one saved)"
    return None


def latest_checkpoint(ckpt_root: Path) -> tuple[Path, dict[str, Any]]:
    """The newest intact checkpoint: the one ``latest`` names, else the newest whole step before it."""
    latest = ckpt_root / "latest"
    steps = sorted((int(m.group(1)), p) for p in ckpt_root.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)))
    if not latest.is_file() and not steps:
        raise UserError(f"--resume: no checkpoint in {ckpt_root}; run without --resume to start fresh")
    named = latest.read_text(errors="replace").strip() if latest.is_file() else ""
    m = re.fullmatch(r"step_(\d+)", named)
    candidates = [ckpt_root / m.group(0)] if m else []  # then the steps before it, newest first
    candidates += [p for n, p in reversed(steps) if not m or n < int(m.group(1))]
    problems = [] if m else [f"{latest} {'names no step (' + repr(named[:40]) + ')' if latest.is_file() else 'is missing'}"]
    for path in candidates:
        if (why := check_checkpoint(path)) is None:
            if problems:
                log.warning("--resume: %s; resuming from %s instead", "; ".join(problems), path)
            return path, json.loads((path / LOOP_STATE).read_text())
        problems.append(f"checkpoint {path.name} is unusable ({why})")
    raise UserError(f"--resume: no intact checkpoint in {ckpt_root} ({'; '.join(problems) or 'latest is empty'}); "
                    "run without --resume (and with --overwrite) to start fresh")

def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> bool:
    """Whether to resume; an old run is never replaced unless asked, one stopped before its first checkpoint restarts."""
    if file := next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None):
        raise UserError(f"--run-dir {run_dir}: {file} is a file, not a folder; pass a folder (or a path that does not "
                        "exist yet)")
    held = [name for name in ("metrics.jsonl", "checkpoints", "final") if (run_dir / name).exists()]
    if resume and (run_dir / "config.json").is_file() and not list(run_dir.glob("checkpoints/step_*[0-9]")):
        log.warning("--resume: %s has no checkpoint yet; starting the run from step 0", run_dir)
        return False
    if resume or not held:
        return resume
    if not overwrite:
        raise UserError(f"{run_dir} already holds a run ({', '.join(held)}); pass --resume to continue it, "
                        "--overwrite to replace it, or choose another --run-dir")
    for name in ("checkpoints", "final"):  # a later --resume must not pick up the old run's checkpoint
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return False


def check_resume(run_dir: Path, cfg: Any) -> int:
    """A resume continues the same run (its environment and model), refused otherwise; the steps its latest
    checkpoint holds (0 if none)."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        saved = {}
    for key in ("env.name", "model.arch", "model.hf_checkpoint"):
        section, name = key.split(".")
        was, now = saved.get(section, {}).get(name, getattr(getattr(cfg, section), name)), getattr(getattr(cfg, section), name)
        if was != now:
            flag = f"--env {was}" if key == "env.name" else f"{key}={was}"
            raise UserError(f"--resume: {run_dir} is a run of {key}={was!r}, not {now!r}; resume it with {flag}, or "
                            "start a new run (another --run-dir, or --overwrite to replace this one)")
    level = log.level
    log.setLevel(logging.ERROR)  # the resume itself says which checkpoint it passes over, once
    try:
        return int(latest_checkpoint(run_dir / "checkpoints")[1].get("step", 0))
    except UserError:  # no intact one: the resume says so
        return 0
    finally:
        log.setLevel(level)


class Interrupted(Exception):
    """SIGINT / SIGTERM: the run stopped after a whole step, saved as ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped after step {step}; checkpoint in {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


class StopSignals:
    """SIGINT / SIGTERM once: stop after this step (``requested``); twice: abort now. Main thread only."""

    def __init__(self) -> None:
        self.requested: str | None = None
        main = threading.current_thread() is threading.main_thread()
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM) if main}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\nmiles-agent: {self.requested}: finishing this step, then saving a checkpoint (send it again "
              "to abort without saving)", file=sys.stderr, flush=True)

    def remove(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
