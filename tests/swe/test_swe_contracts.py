"""The plug-in contracts against swe (local sandbox) and the aci harness."""

from __future__ import annotations

import shutil

import pytest

from miles_agent.environment import HarnessLimits
from miles_agent.harnesses.aci import ACIHarness
from miles_agent.testing.contracts import EnvironmentContract, HarnessContract


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
class TestSWE(EnvironmentContract):
    @pytest.fixture
    def environment(self, swe_env):
        return swe_env

    @pytest.fixture
    def make_sandbox(self):
        from miles_agent.sandboxes.local import LocalSandbox

        return LocalSandbox


class TestACI(HarnessContract):
    limits = HarnessLimits(max_turns=3, max_total_tokens=3000, max_new_tokens_per_turn=24)  # the tools' prompt

    @pytest.fixture
    def harness_class(self):
        return ACIHarness
