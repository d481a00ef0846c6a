"""Every Python package folder is listed in pyproject.toml, so a non-editable install (a wheel, the
Docker image) ships it: the list is explicit because the plug-in folders map into miles_agent.*."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    # folders shipped as package data (e.g. example packages run in another venv) are not packages here
    data_prefixes = {f"{pkg}.{glob.split('/')[0]}" for pkg, globs in setup.get("package-data", {}).items()
                     for glob in globs if "/" in glob}
    found = set()
    for package, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *rel.parts])
            if not any(name == d or name.startswith(d + ".") for d in data_prefixes):
                found.add(name)
    missing = sorted(found - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
