"""pytest for the sandbox, offline: its pure-Python files staged at `SITE`, put on PYTHONPATH.

Slim images and the local sandbox's host Python rarely have pytest, and a sandbox has no network. The
files come from the terminal-bench verifier toolchain's wheel cache when it is prepared (``python -m
miles_agent.envs.terminal_bench.verifier_toolchain prepare``; `.ci/run` prepares it), else from the
pytest installed next to miles-agent. pytest and its dependencies are pure Python, so one copy serves
every CPython an image has (3.9 and later). The sandbox's own pytest, where the image has one, loses:
the staged copy comes first on the path, so every instance is graded by the same runner.
"""

from __future__ import annotations

import functools
import re
import zipfile
from importlib import metadata
from pathlib import Path

from miles_agent.errors import UserError

SITE = "/opt/miles-swe/site"
#: pytest and what it imports on some supported Python (exceptiongroup and tomli below 3.11).
PACKAGES = ("pytest", "pluggy", "iniconfig", "packaging", "pygments", "exceptiongroup", "tomli")
REQUIRED = ("pytest", "pluggy", "iniconfig", "packaging")
REPORT_PLUGIN = "miles_swe_report"


def _version_key(name: str) -> tuple[int, ...]:
    m = re.match(r"[^-]+-([0-9.]+)", name)
    return tuple(int(x) for x in m.group(1).strip(".").split(".") if x.isdigit()) if m else ()


def _from_wheels(wheels: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for package in PACKAGES:
        found = sorted(wheels.glob(f"{package}-*-py3-none-any.whl"), key=lambda p: _version_key(p.name))
        if not found:
            if package in REQUIRED:
                return {}
            continue
        with zipfile.ZipFile(found[-1]) as whl:
            for name in whl.namelist():
                if not name.endswith("/") and not name.split("/")[0].endswith(".dist-info"):
                    files[f"{SITE}/{name}"] = whl.read(name)
    return files


def _from_installed() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for package in PACKAGES:
        try:
            dist = metadata.distribution(package)
        except metadata.PackageNotFoundError:
            if package in REQUIRED:
                return {}
            continue
        for f in dist.files or []:
            if f.parts[0].endswith(".dist-info") or f.parts[0] in ("..", "bin") or f.suffix == ".pyc":
                continue
            path = Path(dist.locate_file(f))
            if path.is_file():
                files[f"{SITE}/{f.as_posix()}"] = path.read_bytes()
    return files


@functools.cache
def pytest_files() -> dict[str, bytes]:
    """Absolute sandbox path -> content: pytest, its dependencies and the report plugin."""
    from miles_agent.envs.terminal_bench.verifier_toolchain import resolve

    toolchain = resolve("auto")
    files = _from_wheels(toolchain.wheels) if toolchain is not None else {}
    files = files or _from_installed()
    if not files:
        raise UserError("swe: pytest is needed in the sandbox and none was found: prepare the offline toolchain "
                        "(python -m miles_agent.envs.terminal_bench.verifier_toolchain prepare) or "
                        "pip install pytest next to miles-agent")
    plugin = Path(__file__).with_name("report_plugin.py").read_bytes()
    return {**files, f"{SITE}/{REPORT_PLUGIN}.py": plugin}
