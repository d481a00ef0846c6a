"""Attacks on the local sandbox, one per class of hole, as root and as an ordinary user.

Every test first runs its attack against an unsandboxed runner and proves that its detector fires
there (so it can never pass vacuously), then runs the same attack in the sandbox and shows it
contained. Where the attack is impossible for the caller even unsandboxed (an ordinary user cannot
write sysctls), the caller's variant is skipped, not passed. As root, the "user" variant runs the
same driver (attack_driver.py) as uid 65534 through ``setpriv``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import attack_driver
import pytest
from sandbox_helpers import needs_bwrap, run

from miles_agent.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec, VerifierRun
from miles_agent.sandboxes.local import LocalSandbox

DRIVER = Path(attack_driver.__file__).resolve()
NOBODY = 65534
IS_ROOT = os.geteuid() == 0
pytestmark = needs_bwrap


@pytest.fixture(params=["root", "user"])
def caller(request) -> str:
    if request.param == "root" and not IS_ROOT:
        pytest.skip("the suite runs as an ordinary user: the root variant needs root")
    return request.param


def attack(caller: str, **request) -> dict:
    """Run one attack (see attack_driver.run_attack) as ``caller``."""
    if caller == "root" or not IS_ROOT:
        return attack_driver.run_attack(request)
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
            sys.executable, str(DRIVER), json.dumps(request)]
    p = subprocess.run(argv, capture_output=True, text=True, cwd="/", timeout=300,
                       env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def both(caller: str, command: str, **kw) -> tuple[dict, dict]:
    return (attack(caller, mode="unsandboxed", command=command, **kw),
            attack(caller, mode="sandbox", command=command, **kw))


# -- 1. host root inside the sandbox ------------------------------------------------------------

SYSCTL_WRITE = ("f=/proc/sys/kernel/printk_ratelimit; v=$(cat $f) && (echo \"$v\" > $f) 2>/dev/null && "
                "echo ESCAPED:sysctl; python3 -c \"import os; os.close(os.open('/proc/sysrq-trigger', "
                "os.O_WRONLY)); print('ESCAPED:sysrq')\" 2>/dev/null; true")  # writes back the same value


def test_no_sysctl_or_sysrq_is_writable(caller):
    """The core_pattern escape starts with a writable /proc/sys: as host root it was."""
    plain, boxed = both(caller, SYSCTL_WRITE)
    if "ESCAPED" not in plain["stdout"]:
        pytest.skip(f"as {caller}, /proc/sys is not writable even unsandboxed: nothing to contain")
    assert "ESCAPED:sysctl" in plain["stdout"]
    assert "ESCAPED" not in boxed["stdout"], boxed


def test_the_callers_kernel_keys_are_unreadable(caller):
    """A key in the caller's session and user keyrings (as a login leaves them) stays out of reach."""
    desc, payload = f"miles-test-{uuid.uuid4().hex[:8]}", f"SECRET-{uuid.uuid4().hex}"
    command = f"python3 -c '{attack_driver.READ_KEY}' {desc}"
    plain, boxed = both(caller, command, key=desc, key_payload=payload)
    assert f"KEY:{payload}" in plain["stdout"], plain  # the detector fires unsandboxed
    assert payload not in boxed["stdout"] + boxed["stderr"], boxed


def test_no_host_path_of_the_workspace_is_visible(caller):
    """bwrap's command line (pid 1), the environment and the mount table show no host path."""
    command = ("{ pwd; cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ /proc/self/mountinfo; } 2>/dev/null | "
               "tr '\\0' '\\n' | grep -e '/miles-[s]andbox-' -e '/miles-[a]ttack-' | head -3; true")
    plain, boxed = both(caller, command)
    assert "miles-attack-" in plain["stdout"], plain
    assert "miles-sandbox-" not in boxed["stdout"], boxed


def test_sandbox_processes_run_as_an_unprivileged_host_uid(marker):
    """Seen from the host: never uid 0 and no capabilities, whatever uid the command sees inside."""
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec())
            command = f"id -u; (exec -a {marker} sleep 3) & sleep 0.5; grep CapEff /proc/self/status"
            task = asyncio.ensure_future(sb.exec(command))
            host = []  # looked for until it shows (a fixed 0.3 s missed it on 2 busy cores)
            while not host and not task.done():
                await asyncio.sleep(0.05)
                host = _host_status_of(marker)
            return await task, host
    r, host = run(main())
    assert r.stdout.splitlines()[0] == "0"  # root inside ...
    assert "CapEff:\t0000000000000000" in r.stdout
    assert host, "the probe process was not found on the host"
    for status in host:  # ... never the host's root
        assert status["Uid"].split()[0] != "0" and status["CapEff"] == "0000000000000000", status


def _host_status_of(token: str) -> list[dict[str, str]]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/status") as f:
                found.append(dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line))
        except OSError:
            continue
    return [s for s in found if s.get("Name") == "sleep"]


# -- 2. verifier integrity ----------------------------------------------------------------------

ALWAYS_FAILS = ("#!/bin/bash\nif python3 -c 'import json, sys; sys.exit(1)'; then echo 1 > /logs/verifier/reward.txt; "
                "else echo 0 > /logs/verifier/reward.txt; fi\n")
CRASHES = "#!/bin/bash\nexit 1\n"
USER_SITE = "d=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p \"$d\" && "
HOOKS = {
    "usercustomize": USER_SITE + "echo 'import os; os._exit(0)' > \"$d/usercustomize.py\"",
    "pth-file": USER_SITE + "echo 'import os; os._exit(0)' > \"$d/zz-agent.pth\"",
    "cwd-module": "echo 'import os; os._exit(0)' > json.py",
    "background-rewriter": ("(mkdir -p /logs/verifier; while :; do echo 1 > /logs/verifier/reward.txt; done) "
                            "> /dev/null 2>&1 &"),
}


def _task(root: Path, test_sh: str) -> Path:
    d = root / f"t-{uuid.uuid4().hex[:6]}"
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n')
    (d / "instruction.md").write_text("Make the tests pass.\n")
    (d / "tests" / "test.sh").write_text(test_sh)
    for p in (d, d / "tests"):
        p.chmod(0o755)
    return d


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_agent_files_cannot_change_the_verifiers_verdict(caller, hook, world_tmp):
    task = _task(world_tmp, ALWAYS_FAILS)
    plain = attack(caller, mode="naive_episode", task_dir=str(task), command=HOOKS[hook])
    assert plain["reward"] == 1.0, plain  # the hook fools a naive runner
    boxed = attack(caller, mode="episode", task_dir=str(task), command=HOOKS[hook])
    assert boxed["reward"] == 0.0 and boxed["parts"]["tests_passed"] == 0.0, boxed


def test_a_forged_reward_file_never_survives(caller, world_tmp):
    task = _task(world_tmp, CRASHES)  # writes no reward at all
    forge = "mkdir -p /logs/verifier 2>/dev/null; echo 1 > /logs/verifier/reward.txt; mkdir -p .harbor/logs/verifier; " \
            "echo 1 > .harbor/logs/verifier/reward.txt; true"
    assert attack(caller, mode="naive_episode", task_dir=str(task), command=forge)["reward"] == 1.0
    boxed = attack(caller, mode="episode", task_dir=str(task), command=forge)
    assert boxed["reward"] == 0.0 and boxed["parts"].get("reward_file_missing") == 1.0, boxed


# -- 3. agent failure disguised as infrastructure ------------------------------------------------

LOCKOUT = ("mkdir -p .harbor/tests .harbor/logs && chmod 0500 .harbor; head -c 64m /dev/zero > fill 2>/dev/null; "
           "chmod 0500 . ; true")
OLD_SETUP = "rm -rf .harbor/tests && mkdir -p .harbor/tests/x"  # what used to run inside, after the agent


def test_an_agent_cannot_make_its_verifier_fail_to_set_up(caller, world_tmp):
    """Locking the folders, filling the disk: the verdict is still the verifier's (here a pass)."""
    prefix = "setpriv --inh-caps=-all --bounding-set=-all -- " if caller == "root" else ""  # as bwrap ran it
    plain = attack(caller, mode="unsandboxed", command=f"{prefix}bash -c '{LOCKOUT}; chmod 0700 .; {OLD_SETUP}'")
    assert plain["exit_code"] != 0, plain  # the old in-sandbox setup fails: the episode was ABORTED
    task = _task(world_tmp, "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    boxed = attack(caller, mode="episode", task_dir=str(task), command=LOCKOUT)  # no SandboxError raised
    assert boxed["reward"] == 1.0, boxed


class _LockedContainer(Sandbox):
    """A container whose agent left the verifier's folders impossible to recreate."""

    name = "locked"

    async def start(self, spec):  # noqa: D102
        pass

    async def exec(self, command, **kw):
        from miles_agent.sandbox import ExecResult
        if command.startswith("rm -rf"):
            return ExecResult(1, "", "rm: cannot remove '/tests': Permission denied", 0.0)
        return ExecResult(0, "/\n", "", 0.0)

    async def read_file(self, path):
        raise FileNotFoundError(path)

    async def write_file(self, path, content):
        pass

    async def stop(self):
        pass


def test_a_verifier_setup_the_agent_broke_scores_zero_with_a_part(world_tmp):
    from miles_agent.envs.terminal_bench.env import TerminalBenchSession
    from miles_agent.envs.terminal_bench.harbor import load_tasks

    verdict = run(_LockedContainer().run_verifier(VerifierRun("bash /tests/test.sh", {"/tests/test.sh": b""})))
    assert verdict.result is None and "Permission denied" in verdict.setup_error
    task = load_tasks(_task(world_tmp, CRASHES).parent)[0]
    reward = run(TerminalBenchSession(task, _LockedContainer(), 10.0, 100).score([]))
    assert reward.value == 0.0 and reward.parts["verifier_setup_failed"] == 1.0


# -- 5. host-wide exhaustion ---------------------------------------------------------------------

FLOOD = ("python3 - <<'EOF'\nimport os\nmade = 0\nfor n, d in enumerate(('.', os.environ.get('TMPDIR', '/tmp'), os.path.expanduser('~'))):\n"
         "    for i in range(3000):\n        try:\n            open(os.path.join(d, f'f{n}-{i}'), 'w').close()\n"
         "            made += 1\n        except OSError:\n            break\nwritten = 0\nfor i in range(40):\n"
         "    try:\n        with open(f'big{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
         "        written += 1 << 20\n    except OSError:\n        break\nprint('made', made, 'written', written)\nEOF")


def test_inodes_and_bytes_are_capped_across_workspace_tmp_and_home(caller):
    limits = {"disk_inodes": 2000, "disk_bytes": 16 << 20, "max_file_bytes": 4 << 20}
    plain, boxed = both(caller, FLOOD, limits=limits)
    made, written = (int(x) for x in plain["stdout"].split()[1::2])
    assert made == 9000 and written == 40 << 20, plain  # unsandboxed, nothing stops either
    made, written = (int(x) for x in boxed["stdout"].split()[1::2])
    assert made <= 2000 and written <= 16 << 20, boxed


def test_open_files_are_capped_per_process(caller):
    command = ("python3 -c \"import os\nfds = []\ntry:\n    while len(fds) < 2000: fds.append(os.open('/dev/null', "
               "os.O_RDONLY))\nexcept OSError: pass\nprint(len(fds))\"")
    plain, boxed = both(caller, command, limits={"max_open_files": 256})
    assert int(plain["stdout"]) > 256, plain
    assert int(boxed["stdout"]) < 256, boxed


def test_a_full_quota_is_the_callers_error_not_the_sandboxes():
    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec(limits=SandboxLimits(disk_bytes=2 << 20)))
            await sb.exec("head -c 4m /dev/zero > fill; true")
            with pytest.raises(OSError) as info:
                await sb.write_file("more.bin", b"x" * (1 << 20))
            assert not isinstance(info.value, SandboxError) and info.value.errno in (errno.ENOSPC, errno.EDQUOT)
            assert (await sb.exec("echo still alive")).stdout == "still alive\n"
    run(main())


def test_every_rlimit_reaches_the_command(caller):
    """However they are applied (on the namespace init, or by a prlimit exec where this process may not
    set another uid's limits), the command runs under exactly the configured rlimits."""
    limits = {"cpu_time_s": 7, "memory_bytes": 300 << 20, "max_file_bytes": 5 << 20, "max_open_files": 333,
              "max_processes": 50}
    command = "echo $(ulimit -St) $(ulimit -Ht) $(ulimit -v) $(ulimit -f) $(ulimit -n) $(ulimit -c)"
    want = f"7 8 {300 << 10} {(5 << 20) // 1024} 333 0"  # bash reports -v and -f in KiB here
    plain, boxed = both(caller, command, limits=limits)
    assert plain["stdout"].strip() != want, plain  # the host's own limits are not these
    assert boxed["stdout"].strip() == want, boxed


def test_limits_that_cannot_be_set_mean_the_command_never_runs(monkeypatch):
    """Fail closed: a namespace init whose limits were refused is never released."""
    from miles_agent.sandboxes import local

    if local.LIMITS_ON_INIT:
        monkeypatch.setattr("resource.prlimit", lambda *a: (_ for _ in ()).throw(PermissionError(1, "refused")))
    else:  # here root lacks CAP_SYS_RESOURCE: the kernel itself refuses
        monkeypatch.setattr(local, "LIMITS_ON_INIT", True)

    async def main():
        async with LocalSandbox() as sb:
            await sb.start(SandboxSpec())
            with pytest.raises(SandboxError, match="could not set the command's limits"):
                await sb.exec("touch ran")
            monkeypatch.setattr(local, "LIMITS_ON_INIT", False)
            monkeypatch.undo()
            return (await sb.exec("ls")).stdout
    assert "ran" not in run(main())
