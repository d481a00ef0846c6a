"""The behavioural suite every container / cloud sandbox must pass: run against the local fakes by each
backend's tests, and against the real services by test_remote_contract.py when credentials are present.

``make`` builds a fresh, unstarted sandbox; each check starts it, uses it and stops it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from miles_agent.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec


async def check_exec_files_env(make: Callable[[], Sandbox]) -> None:
    async with make() as sb:
        await sb.start(SandboxSpec(files={"src/a.txt": b"alpha\n"}, env={"GREETING": "hi"}))
        r = await sb.exec("cat src/a.txt; echo $GREETING $EXTRA; echo oops >&2; exit 3", env={"EXTRA": "x"})
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "alpha\nhi x\n", "oops\n", False)
        await sb.write_file("deep/er/b.bin", bytes(range(256)))
        assert await sb.read_file("/workspace/deep/er/b.bin") == bytes(range(256))
        r = await sb.exec("wc -c < b.bin", cwd="deep/er")
        assert (r.exit_code, r.stdout.strip()) == (0, "256")
        r = await sb.exec("printf made > made.txt")
        assert await sb.read_file("made.txt") == b"made"
        with pytest.raises(SandboxError, match="does not exist"):
            await sb.read_file("missing.txt")
    await sb.stop()  # twice is fine
    with pytest.raises(SandboxError, match="not running"):
        await sb.exec("true")


async def check_timeout_kills(make: Callable[[], Sandbox], marker: str) -> None:
    async with make() as sb:
        await sb.start(SandboxSpec(limits=SandboxLimits(wall_time_s=1.0)))
        start = time.monotonic()
        r = await sb.exec(f"(sleep 30; echo {marker}) & echo started; sleep 30 # {marker}")
        assert r.timed_out and r.limit_hit == "wall_time" and r.exit_code == 137
        assert r.stdout == "started\n"
        assert time.monotonic() - start < 10
        after = await sb.exec(f"sleep 0.5; ps -eo args 2>/dev/null | grep -c '[s]leep 30 # {marker}' || true",
                              timeout_s=20)
        assert after.stdout.strip() in ("", "0"), f"the timed-out command survived: {after.stdout!r}"
        ok = await sb.exec("echo still-alive", timeout_s=20)
        assert (ok.exit_code, ok.stdout, ok.timed_out) == (0, "still-alive\n", False)


async def check_output_cap(make: Callable[[], Sandbox]) -> None:
    async with make() as sb:
        await sb.start(SandboxSpec(limits=SandboxLimits(max_output_bytes=100)))
        r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a")
        assert r.output_truncated and r.limit_hit == "output"
        assert r.stdout.startswith("a" * 50) and r.stdout.endswith("a" * 50) and "4900 bytes dropped" in r.stdout


async def check_episode_exception_and_cancel_stop(make: Callable[[], Sandbox]) -> list[Sandbox]:
    """An exception and a cancellation inside ``async with``; returns the sandboxes for the caller to ask
    the service about."""
    made: list[Sandbox] = []

    async def failing() -> None:
        async with make() as sb:
            made.append(sb)
            await sb.start(SandboxSpec())
            raise ValueError("the agent crashed")

    with pytest.raises(ValueError):
        await failing()

    async def long_episode() -> None:
        async with make() as sb:
            made.append(sb)
            await sb.start(SandboxSpec())
            await sb.exec("sleep 60", timeout_s=120)

    task = asyncio.create_task(long_episode())
    await asyncio.sleep(0.3)
    deadline = time.monotonic() + 60
    while (len(made) < 2 or made[1].handle is None) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)  # the exec is in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(s.handle is None for s in made)
    return made
