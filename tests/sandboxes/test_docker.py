"""The Docker sandbox through the real ``docker`` SDK against a fake Docker Engine API on 127.0.0.1
(tests/sandboxes/fake_docker.py): commands really run (as host subprocesses in the container's folder), and
every test ends by asking the engine which containers still exist."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from fake_docker import FakeDockerEngine
from sandbox_helpers import assert_nothing_left, run

from miles_agent.sandbox import SandboxError, SandboxLimits, SandboxSpec
from miles_agent.sandboxes._remote import RetryPolicy, live_sandboxes

pytest.importorskip("docker")
from miles_agent.sandboxes.docker import EXPIRES_LABEL, LABEL, DockerSandbox, connect  # noqa: E402

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def engine():
    with FakeDockerEngine() as e:
        yield e
        assert e.live() == [], "containers left behind"
    assert not [s for s in live_sandboxes() if s.name == "docker"]


def sandbox(engine: FakeDockerEngine, **kw) -> DockerSandbox:
    kw.setdefault("retry", FAST_RETRY)
    return DockerSandbox(base_url=engine.base_url, **kw)


def test_exec_files_env_and_stop(engine):
    async def episode():
        async with sandbox(engine) as sb:
            await sb.start(SandboxSpec(files={"src/a.txt": b"alpha\n"}, env={"GREETING": "hi"}))
            r = await sb.exec("cat src/a.txt; echo $GREETING $EXTRA; echo oops >&2; exit 3", env={"EXTRA": "x"})
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "alpha\nhi x\n", "oops\n", False)
            await sb.write_file("deep/er/b.bin", bytes(range(256)))
            assert await sb.read_file("/workspace/deep/er/b.bin") == bytes(range(256))
            r = await sb.exec("wc -c < b.bin", cwd="deep/er")
            assert r.stdout.strip() == "256"
            with pytest.raises(SandboxError, match="does not exist"):
                await sb.read_file("missing.txt")
            assert len(engine.live()) == 1
        await sb.stop()  # twice is fine
        with pytest.raises(SandboxError, match="not running"):
            await sb.exec("true")

    run(episode())


def test_limits_ttl_and_labels_reach_the_engine(engine):
    limits = SandboxLimits(memory_bytes=256 << 20, max_processes=64)

    async def episode():
        async with sandbox(engine, cpus=1.5, ttl_s=900) as sb:
            before = time.time()
            await sb.start(SandboxSpec(image="python:3.12-slim", limits=limits))
            body = engine.containers[sb.handle].body
            host = body["HostConfig"]
            assert (host["Memory"], host["PidsLimit"], host["NanoCpus"]) == (256 << 20, 64, 1_500_000_000)
            assert host["NetworkMode"] == "none" and body["NetworkDisabled"] is True and host["AutoRemove"]
            assert body["Cmd"] == ["sleep", "900"] and body["WorkingDir"] == "/workspace"
            assert body["Labels"][LABEL] == "1"
            assert before + 900 - 1 <= int(body["Labels"][EXPIRES_LABEL]) <= time.time() + 900

    run(episode())


def test_exec_timeout_kills_the_command(engine, marker):
    async def episode():
        async with sandbox(engine) as sb:
            await sb.start(SandboxSpec(limits=SandboxLimits(wall_time_s=0.5)))
            start = time.monotonic()
            r = await sb.exec(f"(sleep 30; echo {marker}) & echo started; sleep 30 # {marker}")
            assert r.timed_out and r.limit_hit == "wall_time" and r.exit_code == 137
            assert r.stdout == "started\n"
            assert time.monotonic() - start < 5
            assert_nothing_left(marker, within_s=2)
            ok = await sb.exec("echo still-alive", timeout_s=5)
            assert (ok.exit_code, ok.stdout, ok.timed_out) == (0, "still-alive\n", False)

    run(episode())


def test_output_is_capped(engine):
    async def episode():
        async with sandbox(engine) as sb:
            await sb.start(SandboxSpec(limits=SandboxLimits(max_output_bytes=100)))
            r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a")
            assert r.output_truncated and r.limit_hit == "output"
            assert r.stdout.startswith("a" * 50) and r.stdout.endswith("a" * 50) and "4900 bytes dropped" in r.stdout

    run(episode())


def test_rate_limits_are_retried_with_backoff(engine):
    waits: list[float] = []
    engine.inject("create", 429, times=2, message="toomanyrequests", headers={"Retry-After": "0"})
    engine.inject("exec_create", 503, times=1)

    async def episode():
        async with sandbox(engine, sleep=waits.append) as sb:
            await sb.start(SandboxSpec())
            assert (await sb.exec("echo ok")).stdout == "ok\n"

    run(episode())
    assert engine.calls.count("create") == 3 and engine.calls.count("exec_create") == 2
    assert waits[:2] == [0.0, 0.0] and 0 <= waits[2] <= 0.01  # Retry-After honoured, then jittered back-off


def test_retries_are_bounded_and_leave_nothing(engine):
    engine.inject("start", 503, times=10, message="engine busy")

    async def episode():
        sb = sandbox(engine)
        with pytest.raises(SandboxError, match="start container still failing after 4 attempts"):
            await sb.start(SandboxSpec())
        assert sb.handle is None

    run(episode())
    assert engine.calls.count("start") == 4 and engine.calls.count("remove") == 1


def test_auth_error_names_the_fix(engine):
    engine.inject("create", 403, message="permission denied")
    with pytest.raises(SandboxError, match="DOCKER_HOST"):
        run(sandbox(engine).start(SandboxSpec()))
    assert engine.calls.count("create") == 1


def test_unreachable_engine_is_a_clear_error():
    with pytest.raises(SandboxError, match="cannot reach the Docker engine.*DOCKER_HOST"):
        connect("tcp://127.0.0.1:1", timeout_s=2)


def test_missing_image_is_pulled(engine):
    async def episode():
        async with sandbox(engine) as sb:
            await sb.start(SandboxSpec(image="alpine:3.20"))
            assert (await sb.exec("echo up")).stdout == "up\n"

    run(episode())
    assert engine.calls[:5] == ["version", "image_inspect", "pull", "image_inspect", "create"]
    assert "alpine:3.20" in engine.images


def test_failure_half_way_through_start_removes_the_container(engine):
    engine.inject("put_archive", 400, message="bad archive")  # the workspace folder cannot be made
    with pytest.raises(SandboxError, match="make workspace failed"):
        run(sandbox(engine).start(SandboxSpec()))
    assert "create" in engine.calls and engine.calls[-1] == "remove"


def test_cancelled_start_leaves_no_container(engine):
    engine.delays["start"] = 0.5

    async def episode():
        task = asyncio.create_task(sandbox(engine).start(SandboxSpec()))
        await asyncio.sleep(0.2)
        assert len(engine.live()) == 1  # created, start in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(episode())
    assert engine.calls[-1] == "remove"


def test_exception_or_cancellation_in_the_episode_stops_the_sandbox(engine):
    async def failing():
        async with sandbox(engine) as sb:
            await sb.start(SandboxSpec())
            raise ValueError("the agent crashed")

    with pytest.raises(ValueError):
        run(failing())
    assert engine.live() == []

    async def cancelled():
        async def episode():
            async with sandbox(engine) as sb:
                await sb.start(SandboxSpec())
                await sb.exec("sleep 30", timeout_s=60)

        task = asyncio.create_task(episode())
        while not engine.execs:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancelled())


def test_process_exit_without_stop_removes_the_container(engine):
    code = ("import asyncio; from miles_agent.sandboxes.docker import DockerSandbox; "
            "from miles_agent.sandbox import SandboxSpec; "
            f"sb = DockerSandbox(base_url={engine.base_url!r}); asyncio.run(sb.start(SandboxSpec())); "
            "print('started', flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "started" in out.stdout, out.stderr
    assert engine.calls.count("remove") == 1


def test_ttl_is_a_dead_man_switch(engine):
    sb = sandbox(engine, ttl_s=1)
    run(sb.start(SandboxSpec()))
    cid = sb.handle
    deadline = time.monotonic() + 10
    while cid in engine.live() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cid not in engine.live(), "the container outlived its TTL"
    run(sb.stop())  # already gone: still a clean stop


def test_reaper_removes_only_our_expired_containers(engine):
    api = connect(engine.base_url)
    foreign = api.create_container("python:3.12-slim", command=["sleep", "60"], labels={"owner": "someone"})
    api.start(foreign["Id"])
    ours = sandbox(engine, ttl_s=300)
    fresh = sandbox(engine, ttl_s=3000)
    run(ours.start(SandboxSpec()))
    run(fresh.start(SandboxSpec()))
    assert DockerSandbox.reap(base_url=engine.base_url) == []
    assert DockerSandbox.reap(base_url=engine.base_url, now=time.time() + 600) == [ours.handle]
    assert sorted(engine.live()) == sorted([foreign["Id"], fresh.handle])
    run(ours.stop())
    run(fresh.stop())
    api.remove_container(foreign["Id"], force=True)


def test_reap_command_line(engine, monkeypatch, capsys):
    from miles_agent.cli import main

    sb = sandbox(engine, ttl_s=1)
    run(sb.start(SandboxSpec()))
    # As after an engine restart: the auto-removal is lost, so the expired container stays behind.
    engine.containers[sb.handle].body["HostConfig"]["AutoRemove"] = False
    time.sleep(1.2)
    monkeypatch.setenv("DOCKER_HOST", engine.base_url)
    assert main(["sandbox", "reap", "--backend", "docker"]) == 0
    assert f"removed 1 expired sandbox(es)\n  {sb.handle}" in capsys.readouterr().out
    assert engine.live() == []
    run(sb.stop())
    assert main(["sandbox", "reap", "--backend", "local"]) == 2
    assert "has no reaper" in capsys.readouterr().err


def test_sandbox_options_from_the_config_reach_the_backend(engine):
    from miles_agent.build import sandbox_factory
    from miles_agent.config import load_config
    from miles_agent.errors import UserError

    cfg = load_config(overrides=["env.sandbox=docker",
                                 f'env.sandbox_options={{"base_url": "{engine.base_url}", "ttl_s": 120, "cpus": 0.5}}'])
    sb = sandbox_factory(cfg.env.sandbox, cfg.env.sandbox_options)()
    assert (sb.base_url, sb.ttl_s, sb.cpus) == (engine.base_url, 120.0, 0.5)
    with pytest.raises(UserError, match="base_ulr not accepted by the 'docker' sandbox; valid options: .*base_url"):
        sandbox_factory("docker", {"base_ulr": "x"})
    assert sandbox_factory("local", {}) is sandbox_factory("local")
