"""A process that owns local sandboxes and dies without stopping them (SIGTERM, SIGKILL) leaves none of their
processes behind: not the storage holder, not a command's bwrap, not what a command started in the background
(issue #23: a soak run stopped by SIGTERM left bwrap processes and their background ``sleep`` running).

The owner is a subprocess using the public API, as root and (from a root run) as an ordinary user (uid 65534,
through ``setpriv``): the two build the sandbox's pid namespace differently. Two moments are covered: a command running with a background
process, and a command still being set up (its namespace init waits for its limits: the owner's event loop is
stalled there, as a busy trainer's can be -- the window in which the old layout let the init outlive its owner
and then run the command unlimited).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from sandbox_helpers import needs_bwrap

OWNER = textwrap.dedent("""
    import asyncio, sys, time
    from miles_agent.sandbox import SandboxLimits, SandboxSpec
    from miles_agent.sandboxes import _local_run
    from miles_agent.sandboxes.local import LocalSandbox

    marker, root, moment = sys.argv[1:4]

    def stalled(*_args, **_kw):  # the owner's event loop stuck while a command waits for its limits
        print("ready", flush=True)
        time.sleep(600)

    async def main():
        sb = LocalSandbox(root_dir=root)
        await sb.start(SandboxSpec(limits=SandboxLimits(wall_time_s=600), env={"OWNER_DEATH_MARK": marker}))
        first = await sb.exec(f"(exec -a {marker}-bg sleep 300) & echo started")  # nothing outlives an exec
        assert first.stdout.strip() == "started", first
        if moment == "starting":
            _local_run.set_limits = stalled
            await sb.exec(f"exec -a {marker}-fg sleep 300")
        running = asyncio.create_task(sb.exec(f"(exec -a {marker}-bg sleep 300) & exec -a {marker}-fg sleep 301"))
        while not _live(marker + "-bg"):
            await asyncio.sleep(0.05)
        print("ready", flush=True)
        await running

    def _live(token):
        import os
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and open(f"/proc/{pid}/cmdline", "rb").read().startswith(token.encode()):
                    return True
            except OSError:
                pass
        return False

    asyncio.run(main())
""")


def _sandbox_processes(marker: str) -> list[str]:
    """Live processes of the owner's sandboxes: the marker in their command line or environment (commands,
    their bwrap, its namespace init), or in their mount table (the storage holder mounts under the root)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            blobs = []
            for name in ("cmdline", "environ", "mountinfo"):
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    blobs.append(f.read())
        except (OSError, IndexError):
            continue
        if any(marker.encode() in b for b in blobs):
            cmdline = blobs[0].replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {cmdline[:160]}")
    return found


NOBODY = 65534
IS_ROOT = os.geteuid() == 0


@needs_bwrap
@pytest.mark.parametrize("caller", ["root", "user"])
@pytest.mark.parametrize("moment", ["running", "starting"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_owner_killed_leaves_no_sandbox_process(world_tmp, marker, caller, moment, sig):
    if caller == "root" and not IS_ROOT:
        pytest.skip("the suite runs as an ordinary user: the root variant needs root")
    root = world_tmp / marker  # the holder's mounts lie under it, so its mount table names the marker
    root.mkdir()
    os.chmod(root, 0o777)  # the user variant's sandboxes go here too
    as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] \
        if caller == "user" and IS_ROOT else []
    env = {**os.environ, "TMPDIR": str(root)}  # what a killed owner leaves on disk (its staged /etc) goes too
    owner = subprocess.Popen([*as_user, sys.executable, "-c", OWNER, marker, str(root), moment], cwd="/",
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        if line.strip() != "ready":
            owner.kill()
            pytest.fail(f"the owner did not get ready: {line!r} {owner.communicate(timeout=30)[1][-2000:]}")
        before = _sandbox_processes(marker)
        assert any(f"{marker}-bg" in p for p in before) or moment == "starting", before
        assert len(before) >= 3, before  # holder, bwrap (+ its init), the commands
        owner.send_signal(sig)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        while (left := _sandbox_processes(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"the owner died by {sig.name}; its sandboxes' processes survived: {left}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for line in _sandbox_processes(marker):  # never leave the host littered, even when the test fails
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_empty_cgroups_a_killed_owner_left_are_removed_and_live_ones_kept():
    """An owner killed mid-command leaves that command's (empty) pids cgroup; the next process to make one
    removes those older than a few minutes, never one that holds a process."""
    from miles_agent.sandboxes import _local_isolation as iso

    stale = iso.create_pids_cgroup(f"miles-agent-test-stale-{os.getpid()}", 8)
    if stale is None:
        pytest.skip("no writable pids cgroup here (root, cgroup v1 or delegated v2)")
    busy = iso.create_pids_cgroup(f"miles-agent-test-busy-{os.getpid()}", 8)
    assert busy is not None
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(busy.procs_file, "w") as f:
            f.write(str(sleeper.pid))
        old = time.time() - 2 * iso.STALE_CGROUP_S
        for cg in (stale, busy):
            os.utime(cg.path, (old, old))
        fresh = iso.create_pids_cgroup(f"miles-agent-test-fresh-{os.getpid()}", 8)
        iso.remove_stale_cgroups(stale.parent)
        assert not os.path.exists(stale.path)
        assert os.path.exists(busy.path) and sleeper.pid in busy.pids()
        assert fresh is not None and os.path.exists(fresh.path)
        fresh.remove()
    finally:
        sleeper.kill()
        sleeper.wait()
        deadline = time.monotonic() + 5
        while not busy.remove() and time.monotonic() < deadline:
            time.sleep(0.05)
        stale.remove()
