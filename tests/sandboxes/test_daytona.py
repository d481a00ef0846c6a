"""The Daytona sandbox through the real ``daytona`` SDK against a fake Daytona on 127.0.0.1
(fake_daytona.py): REST control plane and toolbox API, real host processes. Every test ends by asking the
fake which sandboxes still exist."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

pytest.importorskip("daytona")

import remote_suite  # noqa: E402
from fake_daytona import API_KEY, FakeDaytona  # noqa: E402
from sandbox_helpers import assert_nothing_left, run  # noqa: E402

from miles_agent.sandbox import SandboxError, SandboxSpec  # noqa: E402
from miles_agent.sandboxes._remote import RetryPolicy, live_sandboxes  # noqa: E402
from miles_agent.sandboxes.daytona import DaytonaSandbox, unwrap, wrap  # noqa: E402

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def fake():
    with FakeDaytona(minute_s=0.5) as f:
        yield f
        assert f.live() == [], "sandboxes left behind"
    assert not [s for s in live_sandboxes() if s.name == "daytona"]


def maker(fake: FakeDaytona, **kw):
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("api_key", API_KEY)
    return lambda: DaytonaSandbox(api_url=fake.api_url, **kw)


def test_wrapper_frames_exit_code_and_both_streams():
    script = wrap("printf 'a\\nb'; echo err >&2; exit 7", 5)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout
    assert unwrap("noise the shell printed\n" + out) == (7, "a\nb", "err\n")
    with pytest.raises(SandboxError, match="wrapper failed"):
        unwrap("bash: base64: command not found")


def test_exec_files_env_and_stop(fake):
    run(remote_suite.check_exec_files_env(maker(fake)))
    assert fake.calls.count("create") == 1 and fake.calls.count("delete") == 1


def test_create_asks_for_the_ttl_and_no_network(fake):
    async def episode():
        async with maker(fake, ttl_s=150)() as sb:
            await sb.start(SandboxSpec(env={"A": "1"}))
            body = fake.sandboxes[sb.handle.id].body
            assert (body["ttlMinutes"], body["autoStopInterval"], body["autoDeleteInterval"]) == (3, 3, 0)
            assert body["networkBlockAll"] is True and body["env"] == {"A": "1"}
            assert body["labels"]["miles-agent"] == "sandbox" and body["name"].startswith("miles-agent-")

    run(episode())


def test_exec_timeout_kills_the_command(fake, marker):
    run(remote_suite.check_timeout_kills(maker(fake), marker))
    assert_nothing_left(marker, within_s=2)


def test_output_is_capped(fake):
    run(remote_suite.check_output_cap(maker(fake)))


def test_rate_limits_and_server_errors_are_retried(fake):
    waits: list[float] = []
    fake.inject("create", 429, times=2, message="too many requests")
    fake.inject("delete", 503, times=1, message="busy")
    run(remote_suite.check_output_cap(maker(fake, sleep=waits.append)))
    assert fake.calls.count("create") == 3 and fake.calls.count("delete") == 2
    assert len(waits) == 3 and all(0 <= w <= 0.05 for w in waits)


def test_retries_are_bounded(fake):
    fake.inject("create", 429, times=10)
    with pytest.raises(SandboxError, match="create sandbox still failing after 4 attempts"):
        run(maker(fake)().start(SandboxSpec()))
    assert fake.calls.count("create") == 4


def test_bad_or_missing_api_key_names_the_env_var(fake, monkeypatch):
    with pytest.raises(SandboxError, match="DAYTONA_API_KEY"):
        run(maker(fake, api_key="dtn_wrong")().start(SandboxSpec()))
    assert fake.calls.count("create") == 1  # an auth error is not retried
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(SandboxError, match="no API key.*DAYTONA_API_KEY"):
        run(DaytonaSandbox(api_url=fake.api_url).start(SandboxSpec()))


def test_failure_half_way_through_start_deletes_the_sandbox(fake):
    fake.inject("upload", 400, message="invalid file path")
    with pytest.raises(SandboxError, match="write task.txt failed"):
        run(maker(fake)().start(SandboxSpec(files={"task.txt": b"x"})))
    assert fake.calls[0] == "create" and fake.calls[-1] == "delete"


def test_cancelled_start_deletes_the_sandbox(fake):
    fake.delays["execute"] = 0.5  # the workspace is being made when the start is cancelled

    async def episode():
        task = asyncio.create_task(maker(fake)().start(SandboxSpec()))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(episode())
    assert fake.calls[0] == "create" and fake.calls[-1] == "delete"


def test_exception_or_cancellation_in_the_episode_deletes_the_sandbox(fake):
    made = run(remote_suite.check_episode_exception_and_cancel_stop(maker(fake)))
    assert len(made) == 2 and fake.calls.count("delete") == 2


def test_process_exit_without_stop_deletes_the_sandbox(fake):
    code = ("import asyncio; from miles_agent.sandboxes.daytona import DaytonaSandbox; "
            "from miles_agent.sandbox import SandboxSpec; "
            f"sb = DaytonaSandbox(api_key={API_KEY!r}, api_url={fake.api_url!r}); "
            "asyncio.run(sb.start(SandboxSpec())); print('started', flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "started" in out.stdout, out.stderr
    assert fake.calls.count("delete") == 1


def test_ttl_minutes_is_the_dead_man_switch(fake):
    sb = maker(fake, ttl_s=60)()  # one "minute" = 0.5 s in this fake
    run(sb.start(SandboxSpec()))
    sid = sb.handle.id
    deadline = time.monotonic() + 10
    while sid in fake.live() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sid not in fake.live(), "the sandbox outlived its ttl_minutes"
    run(sb.stop())  # already gone: a 404 on delete is still a clean stop
