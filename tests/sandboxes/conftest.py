"""Fixtures for the local sandbox tests (helpers live in sandbox_helpers.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest


@pytest.fixture
def marker() -> str:
    """A unique token to put in a command line and look for on the host."""
    return f"miles-sbx-probe-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def world_tmp():
    """A temp folder any uid may enter (pytest's are 0700): for files a sandbox's own uid must reach."""
    path = Path(tempfile.mkdtemp(prefix="miles-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
