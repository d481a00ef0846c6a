"""The E2B sandbox through the real ``e2b`` SDK against a fake E2B on 127.0.0.1 (fake_e2b.py): the REST
control plane and envd's Connect-RPC process service (served by connectrpc's own server code), with real
host processes. Every test ends by asking the fake which sandboxes still exist."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

pytest.importorskip("e2b")

import remote_suite  # noqa: E402
from fake_e2b import API_KEY, FakeE2B  # noqa: E402
from sandbox_helpers import assert_nothing_left, run  # noqa: E402

from miles_agent.sandbox import SandboxError, SandboxSpec  # noqa: E402
from miles_agent.sandboxes._remote import RetryPolicy, live_sandboxes  # noqa: E402
from miles_agent.sandboxes.e2b import METADATA, E2BSandbox  # noqa: E402

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def fake():
    with FakeE2B() as f:
        yield f
        assert f.live() == [], "sandboxes left behind"
    assert not [s for s in live_sandboxes() if s.name == "e2b"]


def maker(fake: FakeE2B, **kw):
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("api_key", API_KEY)
    return lambda: E2BSandbox(api_url=fake.api_url, sandbox_url=fake.sandbox_url, http_version="1.1", **kw)


def test_exec_files_env_and_stop(fake):
    run(remote_suite.check_exec_files_env(maker(fake)))
    assert fake.calls.count("create") == 1 and fake.calls.count("kill") == 1


def test_create_asks_for_the_ttl_template_and_no_internet(fake):
    async def episode():
        async with maker(fake, ttl_s=600, template="my-template")() as sb:
            await sb.start(SandboxSpec(env={"A": "1"}))
            body = fake.sandboxes[sb.handle.sandbox_id].body
            assert (body["templateID"], body["timeout"], body["envVars"]) == ("my-template", 600, {"A": "1"})
            assert body["allow_internet_access"] is False and body["metadata"] == METADATA

    run(episode())


def test_exec_timeout_kills_the_command(fake, marker):
    run(remote_suite.check_timeout_kills(maker(fake), marker))
    assert_nothing_left(marker, within_s=2)


def test_output_is_capped(fake):
    run(remote_suite.check_output_cap(maker(fake)))


def test_rate_limits_and_busy_service_are_retried(fake):
    waits: list[float] = []
    fake.inject("create", 429, times=2, message="too many sandboxes starting")
    fake.inject("kill", 503, times=1, message="busy")
    run(remote_suite.check_output_cap(maker(fake, sleep=waits.append)))
    assert fake.calls.count("create") == 3 and fake.calls.count("kill") == 2
    assert len(waits) == 3 and all(0 <= w <= 0.05 for w in waits)


def test_retries_are_bounded(fake):
    fake.inject("create", 429, times=10)
    with pytest.raises(SandboxError, match="create sandbox still failing after 4 attempts"):
        run(maker(fake)().start(SandboxSpec()))
    assert fake.calls.count("create") == 4


def test_bad_or_missing_api_key_names_the_env_var(fake, monkeypatch):
    with pytest.raises(SandboxError, match="E2B_API_KEY"):
        run(maker(fake, api_key="e2b_wrong")().start(SandboxSpec()))
    assert fake.calls == ["create"]  # an auth error is not retried
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxError, match="no API key.*E2B_API_KEY"):
        run(E2BSandbox(api_url=fake.api_url).start(SandboxSpec()))


def test_failure_half_way_through_start_kills_the_sandbox(fake):
    fake.inject("files", 507, message="not enough disk space")
    with pytest.raises(SandboxError, match="write task.txt failed.*disk space"):
        run(maker(fake)().start(SandboxSpec(files={"task.txt": b"x"})))
    assert fake.calls[0] == "create" and fake.calls[-1] == "kill"


def test_cancelled_start_kills_the_sandbox(fake):
    fake.delays["create"] = 0.5

    async def episode():
        task = asyncio.create_task(maker(fake)().start(SandboxSpec()))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(episode())
    assert fake.calls[0] == "create" and fake.calls[-1] == "kill"


def test_exception_or_cancellation_in_the_episode_kills_the_sandbox(fake):
    made = run(remote_suite.check_episode_exception_and_cancel_stop(maker(fake)))
    assert len(made) == 2 and fake.calls.count("kill") == 2


def test_process_exit_without_stop_kills_the_sandbox(fake):
    code = ("import asyncio; from miles_agent.sandboxes.e2b import E2BSandbox; "
            "from miles_agent.sandbox import SandboxSpec; "
            f"sb = E2BSandbox(api_key={API_KEY!r}, api_url={fake.api_url!r}, sandbox_url={fake.sandbox_url!r}, "
            "http_version='1.1'); asyncio.run(sb.start(SandboxSpec())); print('started', flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "started" in out.stdout, out.stderr
    assert fake.calls.count("kill") == 1


def test_e2b_timeout_is_the_dead_man_switch(fake):
    sb = maker(fake, ttl_s=1)()
    run(sb.start(SandboxSpec()))
    sid = sb.handle.sandbox_id
    deadline = time.monotonic() + 10
    while sid in fake.live() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sid not in fake.live(), "the sandbox outlived its E2B timeout"
    run(sb.stop())  # already gone: kill answers 404, still a clean stop
