"""Fixtures for the local sandbox tests (helpers live in sandbox_helpers.py)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def marker() -> str:
    """A unique token to put in a command line and look for on the host."""
    return f"miles-sbx-probe-{uuid.uuid4().hex[:10]}"
