"""The sandbox contract (``miles_agent.sandbox.Sandbox``): what environments and harnesses rely on.

Provide ``make_sandbox``: a callable returning a fresh, unstarted sandbox. ``leftover_processes(marker)``
finds processes whose command line holds ``marker`` on this host (right for sandboxes whose commands run
here: local, containers on a local engine); a remote backend overrides it with its own probe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from miles_agent.sandbox import ExecResult, Sandbox, SandboxError, SandboxSpec
from miles_agent.testing.contracts._fixtures import fixture_missing


def host_processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


class SandboxContract:
    @pytest.fixture
    def make_sandbox(self) -> Callable[[], Sandbox]:
        fixture_missing("SandboxContract", "make_sandbox", "a callable that makes an unstarted Sandbox")

    def leftover_processes(self, marker: str) -> list[int]:
        return host_processes_with(marker)

    def test_exec_returns_exit_code_stdout_and_stderr(self, make_sandbox) -> None:
        async def run() -> ExecResult:
            async with make_sandbox() as sb:
                await sb.start(SandboxSpec(env={"GREETING": "hi"}))
                return await sb.exec("echo $GREETING out; echo err >&2; exit 3")

        r = asyncio.run(run())
        assert isinstance(r, ExecResult), type(r)
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hi out\n", "err\n"), r
        assert not r.timed_out

    def test_files_round_trip(self, make_sandbox) -> None:
        payload = bytes(range(256)) * 3

        async def run() -> tuple[bytes, bytes, str, bytes]:
            async with make_sandbox() as sb:
                await sb.start(SandboxSpec(files={"given/a.txt": b"alpha\n"}))
                await sb.write_file("deep/er/b.bin", payload)
                made = await sb.exec("printf made > made.txt && wc -c < deep/er/b.bin")
                return (await sb.read_file("given/a.txt"), await sb.read_file("deep/er/b.bin"), made.stdout,
                        await sb.read_file("made.txt"))

        given, back, size, made = asyncio.run(run())
        assert given == b"alpha\n", "a spec file did not arrive"
        assert back == payload, "write_file then read_file changed the bytes"
        assert size.strip() == str(len(payload)), f"the command saw {size!r} bytes"
        assert made == b"made", "a file a command wrote is not readable"

    def test_reading_a_missing_file_raises(self, make_sandbox) -> None:
        """Never empty bytes. The local backend raises FileNotFoundError (a caller error), the remote ones
        SandboxError; both are accepted until the two agree."""
        async def run() -> bytes:
            async with make_sandbox() as sb:
                await sb.start(SandboxSpec())
                return await sb.read_file("no/such/file")

        with pytest.raises((FileNotFoundError, SandboxError)):
            asyncio.run(run())

    def test_stop_leaves_nothing_running(self, make_sandbox) -> None:
        marker = f"miles-contract-{uuid.uuid4().hex[:10]}"

        async def run() -> Sandbox:
            sb = make_sandbox()
            await sb.start(SandboxSpec())
            await sb.exec(f"(sleep 300; echo {marker}) >/dev/null 2>&1 &", timeout_s=10)
            await sb.stop()
            await sb.stop()  # twice is fine
            return sb

        sb = asyncio.run(run())
        assert not self.leftover_processes(marker), "a process started in the sandbox outlived stop()"
        with pytest.raises(SandboxError):
            asyncio.run(sb.exec("true"))

    def test_sandboxes_do_not_share_files(self, make_sandbox) -> None:
        async def run() -> int:
            async with make_sandbox() as first, make_sandbox() as second:
                await first.start(SandboxSpec())
                await second.start(SandboxSpec())
                await first.write_file("secret.txt", b"mine")
                return (await second.exec("test -e secret.txt")).exit_code

        assert asyncio.run(run()) != 0, "one sandbox sees another's workspace"

    def test_options_type_fields_are_constructor_keywords(self, make_sandbox) -> None:
        """The build step turns ``env.sandbox_options`` into ``options_type`` and passes its fields as keywords."""
        cls = type(make_sandbox())
        options = getattr(cls, "options_type", None)
        if options is None:
            pytest.skip("no options_type: env.sandbox_options reach the constructor unchecked")
        defaults = options()
        try:
            cls(**{f.name: getattr(defaults, f.name) for f in dataclasses.fields(options)})
        except TypeError as e:
            raise AssertionError(f"{options.__name__} has a field {cls.__name__}() does not take: {e}") from None
