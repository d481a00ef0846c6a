"""The local sandbox's ordinary behaviour: exec, exit codes, streams, files, workspaces, modes, refusals."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from sandbox_helpers import assert_nothing_left, needs_bwrap, run

from miles_agent.sandbox import SandboxError, SandboxLimits, SandboxSpec
from miles_agent.sandboxes.local import LocalSandbox

MODES = [pytest.param("bwrap", marks=needs_bwrap), "none"]


async def _started(isolation: str = "bwrap", spec: SandboxSpec | None = None, **kw) -> LocalSandbox:
    sandbox = LocalSandbox(isolation=isolation, **kw)
    await sandbox.start(spec or SandboxSpec())
    return sandbox


@pytest.mark.parametrize("isolation", MODES)
def test_exec_exit_codes_streams_and_files(isolation):
    async def main():
        spec = SandboxSpec(files={"data/in.txt": b"hello\n", "top.sh": b"echo top"}, env={"SPEC_VAR": "s1"})
        async with await _started(isolation, spec) as sb:
            r = await sb.exec("cat data/in.txt; echo oops >&2; exit 7")
            assert (r.exit_code, r.stdout, r.stderr) == (7, "hello\n", "oops\n")
            assert not r.timed_out and not r.output_truncated and r.limit_hit is None and r.duration_s > 0
            r = await sb.exec('echo "$SPEC_VAR $CALL_VAR"; pwd', env={"CALL_VAR": "c1"}, cwd="data")
            assert r.stdout.splitlines()[0] == "s1 c1" and r.stdout.splitlines()[1].endswith("/data")
            await sb.write_file("out/deep/new.txt", b"\x00\xffbytes")
            r = await sb.exec("wc -c < out/deep/new.txt; echo made > made.txt; bash top.sh")
            assert r.stdout.split() == ["7", "top"]
            assert await sb.read_file("made.txt") == b"made\n"
            assert await sb.read_file("out/deep/new.txt") == b"\x00\xffbytes"
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")
            return sb.root
    root = run(main())
    assert not os.path.exists(root), "stop() must delete the workspace"


@needs_bwrap
def test_inside_view_workspace_tmp_home_persist_but_shell_state_does_not():
    async def main():
        async with await _started() as sb:
            r = await sb.exec("pwd; echo $HOME; cd /tmp; echo t > /tmp/t; echo h > ~/h; export X=1")
            assert r.stdout.split() == ["/workspace", "/root"]
            r = await sb.exec('pwd; cat /tmp/t ~/h; echo "x=$X"')
            assert r.stdout.split() == ["/workspace", "t", "h", "x="]
            await sb.write_file("/workspace/abs.txt", b"abs")
            assert (await sb.exec("cat /workspace/abs.txt")).stdout == "abs"
            assert await sb.read_file("/workspace/sub/../abs.txt") == b"abs"
    run(main())


@needs_bwrap
def test_tools_tasks_need_are_there_and_python_is_the_system_one():
    async def main():
        async with await _started() as sb:
            r = await sb.exec("command -v python3; python3 -c 'import json, sqlite3, ssl; print(\"py ok\")'; "
                              "for t in bash ls cat sed awk grep git find xargs sort tar gzip; do "
                              "command -v $t >/dev/null || echo missing $t; done; "
                              "echo a,b | awk -F, '{print $2}'; git --version >/dev/null && echo git ok")
            lines = r.stdout.splitlines()
            if os.path.exists("/usr/bin/python3"):
                assert lines[0] == "/usr/bin/python3"
            assert "py ok" in lines and "b" in lines and "git ok" in lines, r
            assert not [x for x in lines if x.startswith("missing")], r.stdout
            if os.path.exists("/usr/bin/jq"):
                assert (await sb.exec("echo '{\"a\": 5}' | jq .a")).stdout == "5\n"
    run(main())


@needs_bwrap
def test_two_sandboxes_do_not_see_each_other():
    async def main():
        a, b = await _started(), await _started()
        try:
            await a.write_file("mine.txt", b"only a")
            await a.exec("echo from-a > /tmp/a-tmp")
            r = await b.exec(f"ls -A /workspace /tmp; cat {a.root}/fs/workspace/mine.txt")
            assert "mine.txt" not in r.stdout and "a-tmp" not in r.stdout and r.exit_code != 0
            with pytest.raises(FileNotFoundError):
                await b.read_file("mine.txt")
        finally:
            await a.stop()
            await b.stop()
    run(main())


@needs_bwrap
def test_many_sandboxes_run_concurrently():
    async def one(i: int) -> str:
        async with await _started(spec=SandboxSpec(files={"id": str(i).encode()})) as sb:
            results = await asyncio.gather(*(sb.exec("sleep 0.2; cat id") for _ in range(2)))
            return "".join(r.stdout for r in results)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))
    assert run(main()) == [str(i) * 2 for i in range(8)]


def test_output_keeps_head_and_tail_and_marks_the_cut():
    async def main():
        spec = SandboxSpec(limits=SandboxLimits(max_output_bytes=1000))
        async with await _started("none", spec) as sb:
            r = await sb.exec("seq 1 100000")
        assert r.output_truncated and r.limit_hit is None and r.exit_code == 0
        assert r.stdout.startswith("1\n2\n3\n") and r.stdout.endswith("99999\n100000\n")
        assert "bytes of output dropped" in r.stdout and len(r.stdout) < 1100
    run(main())


def test_over_long_command_is_the_agents_error_not_the_sandboxes():
    async def main():
        async with await _started("none") as sb:
            r = await sb.exec("echo " + "x" * 200_000)
            assert r.exit_code == 126 and "script file" in r.stderr
            r = await sb.exec(": " + "y" * 100_000 + "; echo fits")
            assert r.stdout == "fits\n"
    run(main())


def test_container_image_is_refused_with_advice():
    with pytest.raises(SandboxError, match="cannot run container images.*docker"):
        run(LocalSandbox().start(SandboxSpec(image="python:3.12")))


def test_missing_bubblewrap_is_refused_with_the_package_name(tmp_path, monkeypatch):
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        run(LocalSandbox(bwrap_path=str(tmp_path / "no-bwrap")).start(SandboxSpec()))
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH at all
    with pytest.raises(SandboxError, match="not found on PATH.*apt-get install bubblewrap"):
        run(LocalSandbox().start(SandboxSpec()))


@pytest.mark.parametrize("usage, error", [
    ("--unshare-all --json-status-fd FD", "does not work here.*No permissions.*user namespaces"),
    ("--unshare-all --info-fd FD", "too old.*0.5 or newer.*install a newer bubblewrap"),
])
def test_bubblewrap_that_cannot_work_here_is_refused(world_tmp, usage, error):
    fake = world_tmp / "bwrap"  # where the sandbox's unprivileged uid may run it
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --help ]; then echo '{usage}'; exit 0; fi\n"
                    "echo 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    sandbox = LocalSandbox(bwrap_path=str(fake))
    with pytest.raises(SandboxError, match=error):
        run(sandbox.start(SandboxSpec()))
    assert sandbox.root is None  # nothing left behind by the failed start


def test_bubblewrap_the_sandbox_uid_cannot_run_is_refused_with_the_fix(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only a root caller runs bwrap as another uid")
    fake = tmp_path / "bwrap"  # pytest's tmp folders are 0700
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxError, match="unprivileged uid.*install bubblewrap system-wide"):
        run(LocalSandbox(bwrap_path=str(fake)).start(SandboxSpec()))


def test_a_sandbox_folder_its_uid_cannot_enter_is_refused_with_the_fix(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only a root caller runs sandboxes as another uid")
    with pytest.raises(SandboxError, match="cannot be entered.*root_dir="):  # pytest's tmp folders are 0700
        run(LocalSandbox(root_dir=str(tmp_path)).start(SandboxSpec()))


def test_unisolated_mode_is_explicit_logged_and_still_limited(caplog, marker):
    async def main():
        spec = SandboxSpec(limits=SandboxLimits(wall_time_s=1.0))
        async with await _started("none", spec) as sb:
            r = await sb.exec("echo $HOME; pwd")
            home, cwd = r.stdout.split()
            assert cwd.startswith(sb.root) and home.startswith(sb.root)
            r = await sb.exec(f"trap '' TERM; (exec -a {marker} sleep 60) & sleep 60")
            assert r.timed_out and r.limit_hit == "wall_time" and r.exit_code == 124 and r.duration_s < 5
    import miles_agent.sandboxes.local as local
    local._warned_unisolated = False
    with caplog.at_level(logging.WARNING):
        run(main())
    assert "UNISOLATED" in caplog.text
    assert_nothing_left(marker)


def test_lifecycle_errors_are_clear():
    async def main():
        sb = await _started("none")
        with pytest.raises(SandboxError, match="twice"):
            await sb.start(SandboxSpec())
        with pytest.raises(ValueError, match="positive"):
            await sb.exec("true", timeout_s=0)
        await sb.stop()
        await sb.stop()  # safe twice
        with pytest.raises(SandboxError, match="stopped"):
            await sb.exec("true")
        with pytest.raises(SandboxError, match="not started"):
            await LocalSandbox().read_file("x")
    run(main())
    with pytest.raises(ValueError, match="isolation"):
        LocalSandbox(isolation="docker")


@pytest.mark.parametrize("isolation", MODES)
def test_cancelled_exec_and_stop_during_exec_leave_nothing(isolation, marker):
    async def main():
        sb = await _started(isolation)
        task = asyncio.create_task(sb.exec(f"(exec -a {marker} sleep 60) & wait", timeout_s=30))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_nothing_left(marker, within_s=2)
        task = asyncio.create_task(sb.exec(f"(exec -a {marker} sleep 60) & wait", timeout_s=30))
        await asyncio.sleep(0.5)
        await sb.stop()
        with pytest.raises(SandboxError, match="stopped while"):
            await task
    run(main())
    assert_nothing_left(marker)
