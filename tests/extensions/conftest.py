"""User modules for the extension tests: written to a temp folder on sys.path, as a user's package would be."""

from __future__ import annotations

import sys
import textwrap

import pytest


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """``user_module(name, source)`` writes ``name.py`` to a folder on sys.path and returns ``name``."""
    root = tmp_path_factory.mktemp("usermods")
    sys.path.insert(0, str(root))
    written = []

    def write(name: str, source: str) -> str:
        (root / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    sys.path.remove(str(root))
    for name in written:
        sys.modules.pop(name, None)
