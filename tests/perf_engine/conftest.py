"""Shared by the embedded engine's fast-path tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def kernels_built() -> None:
    """Skip where no C++ toolchain could build the engine's CPU kernels; where one is, a failed build fails."""
    from miles_agent.engines.embedded import cpu_kernels

    if cpu_kernels.toolchain_missing():
        pytest.skip(f"{cpu_kernels.toolchain_missing()}: the engine runs its torch forward")
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable_reason()
