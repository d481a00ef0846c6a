"""The driver's own checkpoint: loop state and RNG states, beside the trainer's, written atomically.

Layout of ``<run_dir>/checkpoints``::

    step_N/trainer/          the trainer's checkpoint (model, optimizer, its per-rank RNG)
    step_N/loop_state.json   step, weight version, episode counters, the scheduler's buffer,
                             python / numpy / torch RNG states
    latest                   the name of the newest complete step_N folder

``step_N`` is built as ``step_N.tmp`` and renamed into place, then ``latest`` is rewritten by rename,
so a crash at any moment leaves ``latest`` naming a whole checkpoint (NeMo-RL #3599). The rollout
engine's sampling RNG is not saved because it holds none worth saving: every request's seed is derived
from its place in the task stream (see `miles_agent.rollout.episode_policy`).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from miles_agent.atomic import replace_dir
from miles_agent.errors import UserError

LOOP_STATE = "loop_state.json"


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
    replace_dir(tmp, path)
    latest_tmp = ckpt_root / "latest.tmp"
    latest_tmp.write_text(path.name)
    latest_tmp.rename(ckpt_root / "latest")
    return path


def latest_checkpoint(ckpt_root: Path) -> tuple[Path, dict[str, Any]]:
    latest = ckpt_root / "latest"
    if not latest.is_file():
        raise UserError(f"--resume: no checkpoint in {ckpt_root}; run without --resume to start fresh")
    path = ckpt_root / latest.read_text().strip()
    if not (path / LOOP_STATE).is_file():
        raise UserError(f"--resume: {path} has no {LOOP_STATE}; it was not written by this version of "
                        "miles-agent -- start a new run")
    return path, json.loads((path / LOOP_STATE).read_text())
