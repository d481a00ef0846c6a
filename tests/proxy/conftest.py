"""The proxy tests import their helpers by name (pytest puts this folder on sys.path)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads on shared cores (see tests/rollout/conftest.py)."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
