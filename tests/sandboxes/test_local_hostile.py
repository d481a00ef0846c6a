"""Hostile commands against the local sandbox: every one must be contained (0 escapes), reported, and
leave nothing running on the host."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from sandbox_helpers import assert_nothing_left, needs_bwrap, run

from miles_agent.sandbox import SandboxLimits, SandboxSpec
from miles_agent.sandboxes.local import LocalSandbox

PROJECT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_time_s=10, cpu_time_s=1, memory_bytes=256 << 20, max_processes=64,
                       max_file_bytes=8 << 20, max_output_bytes=64 << 10)


async def _exec(command: str, *, limits: SandboxLimits = LIMITS, timeout_s: float | None = None, **kw):
    async with LocalSandbox(**kw) as sb:
        await sb.start(SandboxSpec(limits=limits))
        return await sb.exec(command, timeout_s=timeout_s)


@pytest.fixture
def host_secrets(tmp_path_factory):
    """Secret files in the host's /tmp and /root (the home) and a secret value; removed afterwards."""
    value = f"SECRET-{uuid.uuid4().hex}"
    files = [Path("/tmp") / f"miles-host-secret-{uuid.uuid4().hex[:8]}", Path.home() / f".miles-secret-{uuid.uuid4().hex[:8]}"]
    for f in files:
        f.write_text(value)
    yield value, files
    for f in files:
        f.unlink(missing_ok=True)


@needs_bwrap
def test_host_secrets_and_project_are_invisible(host_secrets, monkeypatch):
    value, files = host_secrets
    monkeypatch.setenv("MILES_TEST_API_KEY", value)  # the trainer's environment must not leak either
    paths = " ".join(str(f) for f in files)
    r = run(_exec(f"cat {paths} {PROJECT}/pyproject.toml /etc/shadow /root/.bash_history 2>&1; "
                  f"ls -A /home /work {PROJECT} 2>&1; env; cat /proc/*/environ /proc/*/cmdline 2>/dev/null; "
                  "find / \\( -path /proc -o -path /usr \\) -prune -o -name '*miles-*secret*' -print 2>&1; "
                  "cat /etc/passwd"))
    assert value not in r.stdout + r.stderr
    assert "No such file" in r.stdout and "[tool" not in r.stdout  # pyproject content absent
    assert "MILES_TEST_API_KEY" not in r.stdout
    assert "root:x:0:0" in r.stdout and len(r.stdout.split("root:x:0:0")[1].splitlines()) <= 3  # synthesized


@needs_bwrap
def test_writes_never_land_on_the_host():
    name = f"miles-pwned-{uuid.uuid4().hex[:8]}"
    before = os.stat("/etc/hostname").st_mtime_ns
    r = run(_exec(f"echo x > /tmp/{name}; echo x > /root/{name}; echo x > {PROJECT}/{name}; "
                  f"echo x >> /etc/hostname; touch /usr/bin/{name}; mkdir /{name}; "
                  f"mount -t tmpfs none /mnt 2>&1; echo 1 > /proc/sys/kernel/hostname; echo done"))
    assert r.stdout.strip().endswith("done")
    for path in (f"/tmp/{name}", Path.home() / name, PROJECT / name, f"/usr/bin/{name}", f"/{name}"):
        assert not os.path.exists(path), f"the sandbox wrote {path} on the host"
    assert os.stat("/etc/hostname").st_mtime_ns == before


@needs_bwrap
@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "realpath-fallback"])
def test_file_api_refuses_paths_and_symlinks_leading_out(host_secrets, openat2, monkeypatch):
    value, files = host_secrets
    home_secret = files[1]
    if not openat2:  # what kernels before 5.6 get
        from miles_agent.sandboxes import _local_paths
        monkeypatch.setattr(_local_paths, "_have_openat2", False)

    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(files={"ok.txt": b"fine"}))
            await sb.exec(f"ln -s {home_secret} abs; ln -s ../../../../../../..{home_secret} rel; "
                          f"ln -s {home_secret.parent} dir; ln -s /etc/passwd etc; ln -s ok.txt inside")
            for path in ("../x", "/etc/passwd", "/usr/bin/x", "/proc/self/environ", "/", "a/../../x"):
                with pytest.raises(PermissionError):
                    await sb.read_file(path)
                with pytest.raises(PermissionError):
                    await sb.write_file(path, b"pwned")
            # Any other absolute path is in the sandbox's own root (SandboxSpec.files), never the host's.
            host_twin = f"{sb.root}/fs/workspace/ok.txt"
            for path in ("/tmp/x", host_twin, "/root/../../tmp/y"):
                await sb.write_file(path, b"mine")
                assert await sb.read_file(path) == b"mine"
            assert (await sb.exec(f"cat /tmp/x /tmp/y {host_twin}")).stdout == "mine" * 3
            assert not os.path.exists("/tmp/x") and not os.path.exists("/tmp/y")
            assert open(os.path.join(sb.host_path(), "ok.txt"), "rb").read() == b"fine"
            for link in ("abs", "rel", f"dir/{home_secret.name}", "etc"):
                with pytest.raises((PermissionError, FileNotFoundError)):
                    await sb.read_file(link)
                with pytest.raises((PermissionError, FileNotFoundError)):
                    await sb.write_file(link, b"pwned")
            with pytest.raises((PermissionError, FileNotFoundError)):
                await sb.write_file(f"dir/new-{uuid.uuid4().hex[:6]}", b"pwned")
            await sb.exec("mkfifo pipe; ln -s pipe pipelink; mkdir adir")
            for path in ("pipe", "pipelink", "adir"):  # a FIFO would hang the reading thread forever
                with pytest.raises((PermissionError, IsADirectoryError)):
                    await asyncio.wait_for(sb.read_file(path), 5)
                with pytest.raises((PermissionError, IsADirectoryError)):
                    await asyncio.wait_for(sb.write_file(path, b"x"), 5)
            assert await sb.read_file("inside") == b"fine"  # a symlink that stays inside is fine
            await sb.write_file("inside", "через symlink".encode())
            assert await sb.read_file("ok.txt") == "через symlink".encode()
    run(main())
    assert all(f.read_text() == value for f in files)


@pytest.fixture
def host_tcp_service():
    """A TCP server on the host's 127.0.0.1 that records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[tuple] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            accepted.append(addr)
            conn.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@needs_bwrap
def test_no_network_not_even_the_hosts_loopback(host_tcp_service):
    port, accepted = host_tcp_service
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"miles-test-{uuid.uuid4().hex[:8]}"
    abstract.bind("\0" + name)
    abstract.listen()
    try:
        script = (
            "import socket\n"
            "def attempt(family, addr):\n"
            "    s = socket.socket(family, socket.SOCK_STREAM); s.settimeout(2)\n"
            "    try: s.connect(addr); print('CONNECTED', addr)\n"
            "    except OSError as e: print('blocked', type(e).__name__)\n"
            f"attempt(socket.AF_INET, ('127.0.0.1', {port}))\n"
            "attempt(socket.AF_INET, ('1.1.1.1', 53))\n"
            f"attempt(socket.AF_UNIX, '\\0{name}')\n"
            "print('ifaces', sorted(n for _, n in socket.if_nameindex()))\n")
        r = run(_exec(f"python3 -c \"$(cat <<'EOF'\n{script}EOF\n)\"; "
                      f"(echo hi > /dev/tcp/127.0.0.1/{port}) 2>&1 || echo bash-blocked"))
    finally:
        abstract.close()
    assert "CONNECTED" not in r.stdout and r.stdout.count("blocked") >= 4, r
    assert "ifaces ['lo']" in r.stdout
    time.sleep(0.3)
    assert accepted == [], "the sandbox reached a service on the host's loopback"


# A real fork bomb runs only where a kernel limit holds it (a pids cgroup, or RLIMIT_NPROC for a
# non-root user): against the 50 ms watchdog alone it can briefly exhaust the host's pids, which
# would break everything else running on a shared test machine. The watchdog is tested on a bounded
# tree instead (test_process_limit_stops_a_wide_tree).
@pytest.mark.parametrize("kw", [pytest.param({}, marks=needs_bwrap, id="bwrap"),
                                pytest.param({"isolation": "none"}, id="none")])
def test_fork_bomb_is_contained_and_the_host_stays_responsive(kw, marker):
    if not _pids_cgroup_available() and (os.geteuid() == 0 or kw.get("isolation") == "none"):
        pytest.skip("no kernel limit holds a fork bomb here (no writable pids cgroup; root or plain mode)")

    async def main():
        lag = 0.0

        async def ticker():
            nonlocal lag
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - t - 0.01)
        tick = asyncio.create_task(ticker())
        r = await _exec(f"bomb() {{ bomb | bomb & }}; (exec -a {marker} sleep 60) & bomb; wait",
                        timeout_s=20, **kw)
        tick.cancel()
        return r, lag
    r, lag = run(main())
    assert r.limit_hit == "processes" and r.exit_code == 137 and r.duration_s < 10, r
    assert lag < 2.0, f"the host's event loop stalled for {lag:.2f}s"
    assert_nothing_left(marker, within_s=1 if kw.get("isolation") == "none" else 0)


def _pids_cgroup_available() -> bool:
    from miles_agent.sandboxes._local_isolation import create_pids_cgroup
    cg = create_pids_cgroup(f"miles-agent-test-{uuid.uuid4().hex[:6]}", 10)
    if cg is None:
        return False
    cg.remove()
    return True


@pytest.mark.parametrize("kw", [pytest.param({}, marks=needs_bwrap, id="bwrap+cgroup"),
                                pytest.param({"use_cgroups": False}, marks=needs_bwrap, id="bwrap-watchdog"),
                                pytest.param({"isolation": "none"}, id="none+cgroup"),
                                pytest.param({"isolation": "none", "use_cgroups": False}, id="none-watchdog")])
def test_process_limit_stops_a_wide_tree(kw, marker):
    r = run(_exec(f"for i in $(seq 150); do (exec -a {marker} sleep 30) & done; wait", timeout_s=20, **kw))
    assert r.limit_hit == "processes" and r.exit_code == 137 and r.duration_s < 10, r
    assert_nothing_left(marker, within_s=1)


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_memory_bomb_hits_the_memory_limit(isolation):
    r = run(_exec("python3 -c 'a = []\nwhile True: a.append(bytearray(16 << 20))'", isolation=isolation))
    assert r.limit_hit == "memory" and r.exit_code != 0 and "MemoryError" in r.stderr, r


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_disk_fill_stops_at_the_file_size_limit(isolation):
    async def main():
        async with LocalSandbox(isolation=isolation) as sb:
            await sb.start(SandboxSpec(limits=LIMITS))
            r = await sb.exec("head -c 2G /dev/zero > big; python3 -c \"open('big2','wb').write(b'x' * (64 << 20))\"")
            sizes = [os.path.getsize(os.path.join(sb.host_path(), f)) for f in ("big", "big2")]
            return r, sizes
    r, sizes = run(main())
    assert r.limit_hit == "file_size" and r.exit_code != 0, r
    assert max(sizes) <= LIMITS.max_file_bytes


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_cpu_hog_hits_the_cpu_time_limit(isolation):
    r = run(_exec("python3 -c 'while True: pass'", isolation=isolation))
    assert r.limit_hit == "cpu_time" and r.exit_code == 152 and r.duration_s < 8, r


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_sigterm_ignoring_tree_is_killed_by_the_wall_timeout(isolation, marker):
    r = run(_exec(f"trap '' TERM INT HUP; (trap '' TERM; exec -a {marker} sleep 60) & "
                  f"setsid bash -c 'exec -a {marker}-setsid sleep 60' & sleep 60", timeout_s=1, isolation=isolation))
    assert r.timed_out and r.limit_hit == "wall_time" and r.exit_code == 124 and r.duration_s < 4, r
    assert_nothing_left(marker, within_s=1 if isolation == "none" else 0)


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_gigabytes_of_output_are_capped_quickly(isolation):
    for command in ("yes", "head -c 4G /dev/zero >&2", "cat /dev/urandom"):
        t = time.monotonic()
        r = run(_exec(command, isolation=isolation))
        assert r.limit_hit == "output" and r.output_truncated and r.exit_code == 137, (command, r)
        assert len(r.stdout) + len(r.stderr) < 3 * LIMITS.max_output_bytes + 200
        assert time.monotonic() - t < 10


@needs_bwrap
@pytest.mark.parametrize("kw", [{}, {"use_cgroups": False}], ids=["cgroup", "no-cgroup"])
def test_background_processes_never_outlive_their_exec(kw, marker):
    async def main():
        async with LocalSandbox(**kw) as sb:
            await sb.start(SandboxSpec())
            r = await sb.exec(f"(exec -a {marker}-amp sleep 60) & nohup bash -c 'exec -a {marker}-nohup sleep 60' "
                              f">/dev/null 2>&1 & setsid bash -c 'exec -a {marker}-setsid sleep 60' & "
                              f"(setsid bash -c 'exec -a {marker}-double sleep 60' &) ; disown -a; echo started")
            assert r.stdout == "started\n" and r.duration_s < 5
            assert_nothing_left(marker)  # gone when exec returned: the pid namespace was torn down
            r = await sb.exec(f"ps -e -o args | grep -c '^{marker}' || true")  # argv[0] set by exec -a
            assert r.stdout.strip() == "0", "a later exec still sees an earlier exec's background jobs"
    run(main())
    assert_nothing_left(marker)


def test_unisolated_mode_kills_background_jobs_at_exec_end(marker):
    async def main():
        async with LocalSandbox(isolation="none") as sb:
            await sb.start(SandboxSpec())
            r = await sb.exec(f"(exec -a {marker} sleep 60) & echo started")
            assert r.stdout == "started\n" and r.duration_s < 3
    run(main())
    assert_nothing_left(marker, within_s=1)


def test_unisolated_mode_does_not_leak_the_trainers_environment(monkeypatch):
    monkeypatch.setenv("MILES_TEST_API_KEY", "leaked-value")
    r = run(_exec("env", isolation="none"))
    assert "leaked-value" not in r.stdout and "MILES_TEST_API_KEY" not in r.stdout
