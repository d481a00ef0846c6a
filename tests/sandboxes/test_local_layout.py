"""The local sandbox's layout as a container has it: the workdir and absolute files at their real paths,
a root of its own, the network on request, and host folders for the verifier only.

Why: Harbor tasks hard-code and compute absolute paths (/app, /tests, /opt/tool); a sandbox that shows
them elsewhere fails them. The network and the verifier's host folders widen what a command can reach,
so each is shown to reach exactly who it is meant for.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pytest

from miles_agent.errors import UserError
from miles_agent.sandbox import SandboxSpec, VerifierRun

local = pytest.importorskip("miles_agent.sandboxes.local", reason="the local sandbox is not installed")
LocalSandbox = local.LocalSandbox
needs_bwrap = pytest.mark.skipif(not __import__("shutil").which("bwrap"), reason="bubblewrap is not installed")
pytestmark = needs_bwrap


def run(coro):
    return asyncio.run(coro)


def test_workdir_and_absolute_files_are_at_their_real_paths():
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(workdir="/app", files={"in.txt": b"rel", "/opt/tool/bin/t": b"abs"}))
            r = await sb.exec("pwd; cat in.txt /opt/tool/bin/t; echo; ls / | tr '\\n' ' '; echo; echo $HOME; "
                              "mkdir -p /data && echo kept > /data/x")
            assert r.exit_code == 0, r.stderr
            lines = r.stdout.splitlines()
            assert lines[0] == "/app" and lines[1] == "relabs" and lines[3] == "/root"
            assert "workspace" not in lines[2].split() and {"app", "opt", "tmp", "root"} <= set(lines[2].split())
            # The root is the sandbox's own and persists between commands, like a container's.
            assert (await sb.exec("cat /data/x")).stdout == "kept\n"
            assert await sb.read_file("/data/x") == b"kept\n" and await sb.read_file("/app/in.txt") == b"rel"
            await sb.write_file("/app/sub/new.txt", b"n")
            assert (await sb.exec("cat sub/new.txt")).stdout == "n"
            # A command that breaks the merged-usr links does not break the sandbox's next command.
            assert (await sb.exec("rm /bin && mkdir /bin && touch /bin/fake")).exit_code == 0
            assert (await sb.exec("ls /bin/bash && cd /tmp && pwd")).stdout == "/bin/bash\n/tmp\n"
    run(main())


@pytest.mark.parametrize("workdir", ["/workspace/sub", "/home/user/project", "/root", "/srv/../opt/app"])
def test_any_workdir_outside_the_system_folders_is_the_cwd(workdir):
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(workdir=workdir, files={"f": b"x"}))
            return (await sb.exec("pwd; cat f")).stdout
    assert run(main()) == __import__("posixpath").normpath(workdir) + "\nx"


@pytest.mark.parametrize("workdir", ["/usr/src/app", "relative/app", "/etc"])
def test_a_workdir_in_the_system_folders_is_refused(workdir):
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(workdir=workdir))
    with pytest.raises(UserError, match="workdir"):
        run(main())


@pytest.fixture
def toolchain():
    """A provisioned folder every uid may read (the sandbox's own uid mounts it)."""
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="miles-toolchain-", dir="/tmp"))
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_text("provisioned\n")
    root.chmod(0o755)
    yield root
    shutil.rmtree(root)


def test_the_verifier_sees_the_agents_root_with_its_own_tests_logs_and_host_folders(toolchain):

    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(workdir="/app"))
            # The agent plants links where the verifier's folders go, and cannot see the host folder.
            agent = await sb.exec("ls /opt/verifier 2>&1; ln -s /app /tests; mkdir -p /logs/verifier; "
                                  "echo 1 > /logs/verifier/reward.txt; echo out > /app/result")
            assert "No such file" in agent.stdout
            v = await sb.run_verifier(VerifierRun(
                command="cat /opt/verifier/bin/tool /tests/t.sh result; ls /logs/verifier | wc -l; pwd; "
                        "touch /opt/verifier/x 2>&1 | grep -c Read-only; echo 0.5 > /logs/verifier/reward.txt",
                files={"/tests/t.sh": b"test\n"}, outputs=("reward.txt",),
                host_dirs={"/opt/verifier": str(toolchain)}))
            assert v.result is not None and v.result.exit_code == 0, v.result
            assert v.result.stdout.split() == ["provisioned", "test", "out", "0", "/app", "1"]
            assert v.outputs == {"reward.txt": b"0.5\n"}
            after = await sb.exec("ls -A /opt/verifier /tests; cat /app/result")
            assert after.stdout.split() == ["/opt/verifier:", "/tests:", "out"]
    run(main())
    assert not (toolchain / "x").exists()


@pytest.mark.parametrize("inside", ["/usr/lib/x", "/tests", "relative"])
def test_host_folders_may_not_shadow_the_system_or_the_verifiers_own(toolchain, inside):
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec())
            await sb.run_verifier(VerifierRun(command="true", files={"/tests/t": b""}, host_dirs={inside: str(toolchain)}))
    with pytest.raises(UserError, match="verifier host folder"):
        run(main())


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="only a root caller mounts as another uid")
def test_a_host_folder_the_sandbox_uid_cannot_read_is_refused_with_the_fix(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)

    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec())
            await sb.run_verifier(VerifierRun(command="true", files={}, host_dirs={"/opt/v": str(private)}))
    with pytest.raises(UserError, match=r"chmod o\+rx"):
        run(main())


@pytest.fixture
def host_service():
    """A TCP service on the host's loopback: reachable only through the host's network."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"hello from the host\n")
            conn.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


CONNECT = "exec 3<>/dev/tcp/127.0.0.1/{port} && cat <&3"


@pytest.mark.parametrize("policy, asks, reaches", [
    ("task", True, True), ("task", False, False), ("off", True, False), ("on", False, True)])
def test_network_on_request_under_the_operators_policy(host_service, caplog, policy, asks, reaches):
    async def main():
        async with LocalSandbox(network=policy) as sb:
            await sb.start(SandboxSpec(network=asks))
            return await sb.exec(CONNECT.format(port=host_service), timeout_s=10)
    with caplog.at_level(logging.WARNING, logger="miles_agent.sandboxes.local"):
        r = run(main())
    assert (r.stdout == "hello from the host\n") is reaches, r
    overridden = [m for m in caplog.messages if "asks for the network" in m]
    assert bool(overridden) is (policy == "off" and asks)


def test_an_unknown_network_policy_names_the_valid_ones():
    with pytest.raises(UserError, match="'task', 'off', 'on'"):
        LocalSandbox(network="public")


def test_a_workdir_in_home_keeps_the_agents_work_for_the_verifier():
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(workdir="/root"))
            await sb.exec("echo done > result.txt")
            v = await sb.run_verifier(VerifierRun(command="cat /root/result.txt; pwd", files={"/tests/t": b""}))
            assert v.result is not None and v.result.stdout == "done\n/root\n"
    run(main())


def test_a_tar_of_another_uids_files_extracts(tmp_path):
    """Task archives carry their author's uid (1000); with one uid mapped, tar extracts them as root
    (exit 0) rather than failing to restore the owner. chown to an unmapped uid still fails."""
    import subprocess

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("hi\n")
    subprocess.run(["tar", "--owner=1000", "--group=1000", "-cf", str(tmp_path / "u.tar"), "-C", str(tmp_path), "d"],
                   check=True)

    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(workdir="/app", files={"u.tar": (tmp_path / "u.tar").read_bytes()}))
            return await sb.exec("set -e; tar -xf u.tar; cat d/f; stat -c %u d/f; chown 1000 d/f 2>/dev/null || echo no")
    r = run(main())
    assert r.exit_code == 0 and r.stdout.split() == ["hi", "0", "no"], r
