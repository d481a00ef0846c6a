"""The sandbox contract against the local sandbox (bubblewrap), and against sandboxes broken on purpose."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from miles_agent.sandbox import SandboxSpec
from miles_agent.testing.contracts import SandboxContract

local = pytest.importorskip("miles_agent.sandboxes.local", reason="the local sandbox is not installed")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@needs_bwrap
class TestLocalSandbox(SandboxContract):
    @pytest.fixture
    def make_sandbox(self):
        return local.LocalSandbox


class ForgetsToKill(local.LocalSandbox):
    """Runs background jobs where its stop() cannot reach them."""

    async def start(self, spec: SandboxSpec) -> None:
        await super().start(spec)
        self.orphans = []

    async def exec(self, command, **kw):
        if "&" in command:  # run it outside the sandbox's reach, as a leaky backend would
            import subprocess

            self.orphans.append(subprocess.Popen(["bash", "-c", command.replace(" &", "")],
                                                 start_new_session=True))
            return await super().exec("true", **kw)
        return await super().exec(command, **kw)


class MergesStreams(local.LocalSandbox):
    """Returns stderr inside stdout."""

    async def exec(self, command, **kw):
        r = await super().exec(command, **kw)
        return dataclasses.replace(r, stdout=r.stdout + r.stderr, stderr="")


@needs_bwrap
def test_broken_sandboxes_fail_the_contract():
    contract = SandboxContract()
    made: list[ForgetsToKill] = []

    def leaky():
        made.append(ForgetsToKill())
        return made[-1]

    try:
        with pytest.raises(AssertionError, match="outlived stop"):
            contract.test_stop_leaves_nothing_running(leaky)
    finally:
        for sb in made:
            for p in sb.orphans:
                p.kill()
                p.wait()
    with pytest.raises(AssertionError):
        contract.test_exec_returns_exit_code_stdout_and_stderr(MergesStreams)


@dataclasses.dataclass(frozen=True)
class _TooManyOptions(local.LocalSandboxOptions):
    colour: str = "blue"


class OptionsOutOfStep(local.LocalSandbox):
    """Declares an option its constructor does not take."""

    options_type = _TooManyOptions


def test_options_out_of_step_with_the_constructor_fail_the_contract():
    with pytest.raises(AssertionError, match="_TooManyOptions has a field OptionsOutOfStep.. does not take"):
        SandboxContract().test_options_type_fields_are_constructor_keywords(OptionsOutOfStep)
