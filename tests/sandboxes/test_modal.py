"""The Modal sandbox against a double of the ``modal`` SDK's Python API (modal_double.py: the SDK's real
exception classes, real host processes). Modal's gRPC wire protocol is not faked; see the double's docstring.
Every test ends by asking the double which sandboxes still exist."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("modal")

import remote_suite  # noqa: E402
from modal_double import ModalDouble, exception  # noqa: E402
from sandbox_helpers import assert_nothing_left, run  # noqa: E402

from miles_agent.sandbox import SandboxError, SandboxLimits, SandboxSpec  # noqa: E402
from miles_agent.sandboxes._remote import RetryPolicy, live_sandboxes  # noqa: E402
from miles_agent.sandboxes.modal import TAGS, ModalSandbox  # noqa: E402

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def double():
    with ModalDouble() as d:
        yield d
        assert d.live() == [], "sandboxes left behind"
    assert not [s for s in live_sandboxes() if s.name == "modal"]


def maker(double: ModalDouble, **kw):
    kw.setdefault("retry", FAST_RETRY)
    return lambda: ModalSandbox(sdk=double, **kw)


def test_exec_files_env_and_stop(double):
    run(remote_suite.check_exec_files_env(maker(double)))
    assert double.calls.count("create") == 1 and double.calls.count("terminate") == 1


def test_create_asks_for_the_ttl_limits_and_no_network(double):
    async def episode():
        async with maker(double, ttl_s=600.5, cpu=2.0)() as sb:
            await sb.start(SandboxSpec(image="alpine:3.20", limits=SandboxLimits(memory_bytes=512 << 20)))
            kw = double.sandboxes[sb.handle.object_id].kwargs
            assert (kw["timeout"], kw["memory"], kw["cpu"], kw["block_network"]) == (601, 512, 2.0, True)
            assert kw["image"].tag == "alpine:3.20" and kw["workdir"] == "/workspace" and kw["tags"] == TAGS

    run(episode())


def test_exec_timeout_kills_the_command(double, marker):
    run(remote_suite.check_timeout_kills(maker(double), marker))
    assert_nothing_left(marker, within_s=2)


def test_output_is_capped(double):
    run(remote_suite.check_output_cap(maker(double)))


def test_rate_limits_and_connection_errors_are_retried(double):
    waits: list[float] = []
    double.inject("create", exception.ResourceExhaustedError("rate limit exceeded"), times=2)
    double.inject("terminate", exception.ConnectionError("connection reset"), times=1)
    run(remote_suite.check_output_cap(maker(double, sleep=waits.append)))
    assert double.calls.count("create") == 3 and double.calls.count("terminate") == 2
    assert len(waits) == 3 and all(0 <= w <= 0.05 for w in waits)


def test_retries_are_bounded(double):
    double.inject("create", exception.ResourceExhaustedError("rate limit exceeded"), times=10)
    with pytest.raises(SandboxError, match="create sandbox still failing after 4 attempts"):
        run(maker(double)().start(SandboxSpec()))
    assert double.calls.count("create") == 4


def test_auth_error_names_the_fix(double):
    double.inject("lookup", exception.AuthError("Token missing"))
    with pytest.raises(SandboxError, match="MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"):
        run(maker(double)().start(SandboxSpec()))
    assert double.calls == ["lookup"]


def test_failure_half_way_through_start_terminates_the_sandbox(double):
    double.inject("write_bytes", exception.SandboxFilesystemError("disk full"))
    with pytest.raises(SandboxError, match="write task.txt failed.*disk full"):
        run(maker(double)().start(SandboxSpec(files={"task.txt": b"x"})))
    assert double.calls[-1] == "terminate"


def test_cancelled_start_terminates_the_sandbox(double):
    double.delays["make_directory"] = 0.5

    async def episode():
        task = asyncio.create_task(maker(double)().start(SandboxSpec()))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(episode())
    assert double.calls[-1] == "terminate"


def test_exception_or_cancellation_in_the_episode_terminates_the_sandbox(double):
    made = run(remote_suite.check_episode_exception_and_cancel_stop(maker(double)))
    assert len(made) == 2 and double.calls.count("terminate") == 2


def test_modal_timeout_is_the_dead_man_switch(double):
    sb = maker(double, ttl_s=1)()
    run(sb.start(SandboxSpec()))
    sid = sb.handle.object_id
    deadline = time.monotonic() + 10
    while sid in double.live() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sid not in double.live(), "the sandbox outlived its Modal timeout"
    run(sb.stop())  # already gone: NotFound on terminate is a clean stop
