"""A package's own virtual environment, created once and cached by what it pins.

Adapters run their package in a separate venv because the packages cannot share one with the trainer
(or with each other): Harbor needs Python >= 3.12, Verifiers and HUD pin conflicting dependencies.
The venv lives at ``$MILES_AGENT_CACHE/venvs/<name>-<hash>`` (default ``~/.cache/miles-agent``), where
the hash covers the interpreter version and the requirement pins, so a new pin gets a new venv and an
old one is never half-upgraded. Creation goes to a temporary folder renamed into place when pip has
finished, under a file lock, so concurrent workers neither race nor see a broken venv.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from miles_agent.errors import UserError

#: Set for every side-car: no telemetry, no price-list or model-hub downloads at import.
OFFLINE_ENV = {
    "HARBOR_TELEMETRY": "0", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HUD_TELEMETRY_ENABLED": "false",
    "PYTHONUNBUFFERED": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def cache_dir() -> Path:
    return Path(os.environ.get("MILES_AGENT_CACHE", Path.home() / ".cache" / "miles-agent"))


def find_python(version: str | None) -> str:
    """The interpreter for a venv: this one when no version is asked, else pythonX.Y on PATH or in pyenv."""
    if not version or f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    # A pyenv shim on PATH may exist without that version being active: try each candidate for real.
    candidates = [shutil.which(f"python{version}"),
                  *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")), reverse=True)]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    raise UserError(f"this adapter needs Python {version}, which is not installed; install it "
                    f"(e.g. `pyenv install {version}` or your OS package python{version}) and retry")


@dataclass(frozen=True)
class PackageVenv:
    """A cached venv holding ``requirements`` (pip specifiers or local paths) under Python ``python``."""

    name: str
    requirements: tuple[str, ...]
    python: str | None = None  # "3.12"; None = the trainer's own version

    @cached_property
    def path(self) -> Path:
        interpreter = find_python(self.python)
        version = subprocess.run([interpreter, "-c", "import sys; print(sys.version)"], capture_output=True,
                                 text=True, check=True).stdout.strip()
        key = hashlib.sha256("\n".join([version, *self.requirements]).encode()).hexdigest()[:12]
        return cache_dir() / "venvs" / f"{self.name}-{key}"

    def ensure(self) -> Path:
        """The venv's python, creating the venv first if needed (minutes the first time, then instant)."""
        target = self.path
        python = target / "bin" / "python"
        if (target / ".ready").exists():
            return python
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be creating the same venv
            if not (target / ".ready").exists():
                self._create(target)
        return python

    def _create(self, target: Path) -> None:
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        env = {**os.environ, **OFFLINE_ENV}
        steps = [[find_python(self.python), "-m", "venv", str(tmp)],
                 [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *self.requirements]]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                raise UserError(f"cannot create the {self.name} venv ({' '.join(argv[2:5])} ...):\n"
                                f"{done.stderr[-2000:]}\nfix the cause (network to the package index, a "
                                f"pin that does not resolve) and retry; nothing was cached")
        (tmp / ".ready").write_text("\n".join(self.requirements) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        # venv scripts hard-code their folder: pip's entry points in tmp/bin would point at tmp, so run
        # everything as `python -m ...` through the final path (the interpreter itself is relocatable).
        tmp.rename(target)
        _fix_pyvenv(target, tmp)


def _fix_pyvenv(target: Path, old: Path) -> None:
    """Rewrite the absolute paths venv and pip wrote into scripts, so console scripts still run."""
    for script in (target / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            try:
                text = script.read_text()
            except UnicodeDecodeError:
                continue
            if str(old) in text:
                script.write_text(text.replace(str(old), str(target)))
