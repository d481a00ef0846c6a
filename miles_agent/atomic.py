"""Atomic folder writes: build the new folder beside the old one, then swap it in by rename, so a crash
never leaves a half-written checkpoint where a reader expects a whole one."""

from __future__ import annotations

import shutil
from pathlib import Path


def replace_dir(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted last."""
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)
