"""An offline verifier toolchain: uv and a wheel cache, so Harbor test.sh scripts run with no network.

A typical Terminal-Bench verifier installs its own tools: ``curl -LsSf https://astral.sh/uv/…/install.sh | sh;
source $HOME/.local/bin/env; uv venv; uv pip install pytest==8.4.1; uv run pytest /tests/…`` (or ``uvx -w
pytest==8.4.1 pytest …``). Offline, or on an air-gapped cluster, every step of that fails. The toolchain
is a host folder, prepared once where PyPI is reachable::

    python -m miles_agent.envs.terminal_bench.verifier_toolchain prepare [--dest DIR] [--tasks TASKS_DIR]
                                                                          [--requirement REQ ...]

holding ``bin/uv`` and ``bin/uvx`` (from the ``uv`` wheel on PyPI), ``wheels/`` (``pip download`` of the
default requirements, the pins found in ``--tasks``' test.sh files and any ``--requirement``, for CPython
3.11-3.13 on manylinux x86_64) and ``env`` (what uv's installer writes to ``$HOME/.local/bin/env``).

At verify time the sandbox sees it read-only at `MOUNT` (`VerifierRun.host_dirs`; the agent never does),
`setup_command` lays out ``$HOME/.local/bin/{uv,uvx,env}`` as uv's installer would (so the script's own
``curl | sh``, failing offline, changes nothing and ``source $HOME/.local/bin/env`` works), and `env_vars`
make uv and pip resolve from the wheel cache only: UV_OFFLINE, UV_NO_INDEX, UV_FIND_LINKS, PIP_NO_INDEX,
PIP_FIND_LINKS, UV_PYTHON_DOWNLOADS=never (Python comes from the image), a writable UV_CACHE_DIR. A pin the
cache lacks fails the verifier with uv's own message naming the package; add it with ``--requirement``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from miles_agent.errors import UserError


def default_dest() -> Path:
    """Where ``prepare`` puts the toolchain and "auto" looks for it. For root it is /var/cache: the local
    sandbox runs a root caller's verifier as an unprivileged uid, which cannot enter /root."""
    if os.geteuid() == 0:
        return Path("/var/cache/miles-agent/verifier-toolchain")
    return Path("~/.cache/miles-agent/verifier-toolchain").expanduser()


MOUNT = "/opt/miles-verifier-toolchain"
PYTHONS = ("3.11", "3.12", "3.13")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")
#: What Terminal-Bench and Harbor test.sh files install most: pytest at the pins they use, the CTRF
#: reporter Harbor's templates add, and the plugins their tests import.
DEFAULT_REQUIREMENTS = ("pytest==8.4.1", "pytest==8.3.5", "pytest==8.3.4", "pytest", "pytest-json-ctrf==0.3.5",
                        "pytest-json-ctrf", "pytest-timeout", "pytest-asyncio", "requests")
VERIFIER_CACHE = "/tmp/.miles-verifier/uv-cache"  # inside the fresh /tmp the base run_verifier makes
ENV_SCRIPT = """#!/bin/sh
# Written by miles-agent's verifier toolchain, as uv's installer writes $HOME/.local/bin/env.
case ":${PATH}:" in
    *:"$HOME/.local/bin":*) ;;
    *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
"""
# Pins in a test.sh: `pytest==8.4.1`, `-w pytest==8.4.1`, `uv add a==1 b==2`, `pip install "x==1"`.
_PIN = re.compile(r"""(?<![\w./-])([A-Za-z][A-Za-z0-9._-]*(?:\[[A-Za-z0-9_,.-]+\])?==[A-Za-z0-9.*+!_-]+)""")


@dataclass(frozen=True)
class Toolchain:
    """A prepared toolchain folder on the host."""

    root: Path

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    def check(self) -> Toolchain:
        missing = [p for p in (self.root / "bin" / "uv", self.root / "env", self.wheels) if not p.exists()]
        if missing:
            raise UserError(f"verifier toolchain {self.root} is incomplete ({', '.join(map(str, missing))} missing); "
                            "prepare it: python -m miles_agent.envs.terminal_bench.verifier_toolchain prepare "
                            f"--dest {self.root}")
        return self

    def host_dirs(self) -> dict[str, str]:
        return {MOUNT: str(self.root)}

    @staticmethod
    def env_vars() -> dict[str, str]:
        wheels = f"{MOUNT}/wheels"
        return {"UV_OFFLINE": "1", "UV_NO_INDEX": "1", "UV_FIND_LINKS": wheels, "UV_PYTHON_DOWNLOADS": "never",
                "UV_PYTHON_PREFERENCE": "only-system", "UV_CACHE_DIR": VERIFIER_CACHE, "UV_LINK_MODE": "copy",
                "UV_NO_PROGRESS": "1", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": wheels,
                "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    @staticmethod
    def setup_command() -> str:
        """Shell that lays out what uv's installer leaves in $HOME and puts it last on PATH (run before
        test.sh: the task's own PATH keeps its order; ``source $HOME/.local/bin/env`` puts uv first, as the
        real installer's does); a no-op on a backend that did not mount the toolchain."""
        return (f'if [ -x {MOUNT}/bin/uv ]; then mkdir -p "$HOME/.local/bin" && '
                f'ln -sf {MOUNT}/bin/uv {MOUNT}/bin/uvx "$HOME/.local/bin/" && '
                f'cp {MOUNT}/env "$HOME/.local/bin/env" && export PATH="$PATH:$HOME/.local/bin"; fi')


def resolve(setting: str | os.PathLike | None) -> Toolchain | None:
    """The toolchain a setting names: a path (must be prepared), "auto" (the default folder when prepared,
    else none) or "none"/None."""
    if setting is None or str(setting) == "none":
        return None
    if str(setting) == "auto":
        root = default_dest()
        return Toolchain(root) if (root / "bin" / "uv").exists() and (root / "env").exists() else None
    return Toolchain(Path(setting).expanduser()).check()


def task_requirements(tasks_dir: Path) -> list[str]:
    """Every ``name==version`` pin in the tasks' tests/test.sh files (what their verifiers install)."""
    pins: set[str] = set()
    for script in sorted(Path(tasks_dir).expanduser().glob("**/tests/test.sh")):
        text = script.read_text(encoding="utf-8", errors="replace").replace("\\\n", " ")  # join continuations
        for line in text.splitlines():
            if re.search(r"\b(uv|uvx|pip3?|python3? -m pip)\b", line) and "==" in line:
                pins.update(m.group(1).rstrip(".") for m in _PIN.finditer(line.replace('"', " ").replace("'", " ")))
    return sorted(pins)


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"verifier toolchain: `{' '.join(cmd[2:])}` failed:\n{done.stderr.strip()[-2000:]}")


def _platform_args() -> list[str]:
    return ["--only-binary=:all:", *(a for p in PLATFORMS for a in ("--platform", p))]


def prepare(dest: Path, requirements: list[str], pythons: tuple[str, ...] = PYTHONS, uv_version: str | None = None,
            log=print) -> Toolchain:  # noqa: ANN001 - a print-like callable
    """Make (or extend) the toolchain at ``dest``: uv's binaries, then the wheels of ``requirements`` for
    each Python. Needs PyPI (or a pip index configured for pip)."""
    dest = dest.expanduser()
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    (dest / "wheels").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log(f"verifier toolchain: uv{'==' + uv_version if uv_version else ''} from PyPI")
        _pip("--no-deps", "-d", tmp, *_platform_args(), "--python-version", pythons[-1],
             f"uv=={uv_version}" if uv_version else "uv")
        wheel = next(Path(tmp).glob("uv-*.whl"), None)
        if wheel is None:
            raise UserError("verifier toolchain: pip downloaded no uv wheel for manylinux x86_64")
        with zipfile.ZipFile(wheel) as zf:
            for name in ("uv", "uvx"):
                member = next((m for m in zf.namelist() if m.endswith(f".data/scripts/{name}")), None)
                if member is None:
                    raise UserError(f"verifier toolchain: {wheel.name} has no {name} binary")
                target = dest / "bin" / name
                target.write_bytes(zf.read(member))
                target.chmod(0o755)
        version = wheel.name.split("-")[1]
    for python in pythons:
        log(f"verifier toolchain: {len(requirements)} requirement(s) for Python {python}")
        for req in requirements:  # one at a time: a pin that has no wheel for this Python is skipped, not fatal
            try:
                _pip("-d", str(dest / "wheels"), *_platform_args(), "--python-version", python,
                     "--implementation", "cp", req)
            except UserError as e:
                log(f"verifier toolchain: skipped {req} for Python {python}: {str(e).splitlines()[-1][:200]}")
    _marker_closure(dest / "wheels", log)
    (dest / "env").write_text(ENV_SCRIPT)
    manifest = {"uv": version, "pythons": list(pythons), "requirements": sorted(set(requirements)),
                "wheels": sorted(p.name for p in (dest / "wheels").glob("*.whl"))}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"verifier toolchain: ready at {dest} (uv {version}, {len(manifest['wheels'])} wheels)")
    return Toolchain(dest)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_requires(wheel: Path) -> list[str]:
    """A wheel's Requires-Dist, markers dropped, extras' requirements left out."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next((m for m in zf.namelist() if m.endswith(".dist-info/METADATA")), None)
        text = zf.read(meta).decode("utf-8", errors="replace") if meta else ""
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req, _, marker = line[len("Requires-Dist:"):].partition(";")
            if "extra" not in marker:
                reqs.append(req.strip().replace(" ", ""))
    return reqs


def _marker_closure(wheels: Path, log) -> None:  # noqa: ANN001 - a print-like callable
    """Add the dependencies pip skipped for their markers (colorama on Windows, tomli before 3.11): uv's
    universal lock (``uv add``) resolves every platform and needs them present too. Best effort: one
    that has no wheel for these platforms is reported and left out."""
    tried: set[str] = set()
    while True:
        have = {_norm(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
        wanted = {req for w in wheels.glob("*.whl") for req in _wheel_requires(w)}
        todo = sorted(r for r in wanted if _norm(re.split(r"[<>=!~\[(]", r)[0]) not in have and r not in tried)
        if not todo:
            return
        for req in todo:
            tried.add(req)
            try:
                _pip("--no-deps", "-d", str(wheels), "--only-binary=:all:", req)
                continue
            except UserError:
                pass
            try:  # a backport for old Pythons only: its pure wheel, as an old Python would get it
                _pip("--no-deps", "-d", str(wheels), "--only-binary=:all:", "--python-version", "3.8", req)
            except UserError as e:
                log(f"verifier toolchain: no wheel for {req} (needed on other platforms only): "
                    f"{str(e).splitlines()[-1][:160]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_agent.envs.terminal_bench.verifier_toolchain",
                                     description="Prepare the offline verifier toolchain (uv + a wheel cache).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download uv and the wheels verifiers install (needs PyPI)")
    p.add_argument("--dest", type=Path, default=default_dest(), help=f"the folder (default {default_dest()})")
    p.add_argument("--requirement", "-r", action="append", default=[],
                   help="an extra requirement (e.g. numpy==2.3.1) or a requirements file; repeatable")
    p.add_argument("--tasks", type=Path, action="append", default=[],
                   help="a Harbor tasks folder: add every pin its tests/test.sh files install")
    p.add_argument("--python", action="append", help=f"Python versions (default {', '.join(PYTHONS)})")
    p.add_argument("--uv-version", help="the uv release (default: the newest on PyPI)")
    args = parser.parse_args(argv)
    reqs = list(DEFAULT_REQUIREMENTS)
    for item in args.requirement:
        path = Path(item).expanduser()
        if path.is_file():
            reqs += [ln.split("#")[0].strip() for ln in path.read_text().splitlines() if ln.split("#")[0].strip()]
        else:
            reqs.append(item)
    for tasks in args.tasks:
        found = task_requirements(tasks)
        print(f"verifier toolchain: {len(found)} pin(s) in {tasks}'s test.sh files: {', '.join(found) or '-'}")
        reqs += found
    try:
        prepare(args.dest, list(dict.fromkeys(reqs)), tuple(args.python or PYTHONS), args.uv_version)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

