"""Runs one attack as the calling user and prints what happened as JSON: either unsandboxed (a plain
``bash -c`` in a scratch folder, the way a naive runner would) or in a real `LocalSandbox`.

The attack tests start it in a subprocess so that the same attack runs as root and as an ordinary
user (``setpriv --reuid``) from one pytest run; as its own user it runs in-process too.

    python attack_driver.py '{"mode": "sandbox", "command": "...", "limits": {...}, "key": "desc"}'
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

_KEYCTL, _ADD_KEY = 250, 248  # x86_64 syscall numbers
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the sandbox's PATH
KEY_SPEC_SESSION_KEYRING = -3
KEY_SPEC_USER_KEYRING = -4
_libc = ctypes.CDLL(None, use_errno=True)

# Python that reads a "user" key by description from the session and the user keyring (keyctl(2)).
READ_KEY = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for ring in (-3, -4):
    key = libc.syscall(250, 10, ring, b"user", sys.argv[1].encode(), 0)  # KEYCTL_SEARCH
    if key > 0:
        buf = ctypes.create_string_buffer(4096)
        n = libc.syscall(250, 11, key, buf, 4096)  # KEYCTL_READ
        if n > 0:
            print("KEY:" + buf.raw[:n].decode())
"""


def add_key(description: str, payload: str, ring: int) -> int:
    """A user-type key readable by its possessor and its owner uid (the common default)."""
    key = _libc.syscall(ctypes.c_long(_ADD_KEY), b"user", description.encode(), payload.encode(),
                        ctypes.c_size_t(len(payload)), ctypes.c_long(ring))
    if key < 0:
        raise OSError(ctypes.get_errno(), "add_key")
    _libc.syscall(ctypes.c_long(_KEYCTL), ctypes.c_long(5), ctypes.c_long(key), ctypes.c_ulong(0x3f030000))
    return key


def revoke_key(key: int) -> None:
    _libc.syscall(ctypes.c_long(_KEYCTL), ctypes.c_long(3), ctypes.c_long(key))  # KEYCTL_REVOKE


def unsandboxed(command: str, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="miles-attack-") as scratch:
        os.mkdir(os.path.join(scratch, "tmp"))  # the command's /tmp, so that no attack litters the host's
        try:
            p = subprocess.run(["bash", "-c", command], cwd=scratch, capture_output=True, text=True,
                               timeout=timeout_s, env={"PATH": SYSTEM_PATH, "HOME": scratch,
                                                                    "TMPDIR": os.path.join(scratch, "tmp")})
            return {"exit_code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
        except subprocess.TimeoutExpired as e:
            return {"exit_code": 124, "stdout": (e.stdout or b"").decode(errors="replace"), "stderr": ""}


async def sandboxed(command: str, timeout_s: float, limits: dict[str, Any]) -> dict[str, Any]:
    from miles_agent.sandbox import SandboxLimits, SandboxSpec
    from miles_agent.sandboxes.local import LocalSandbox

    async with LocalSandbox() as sb:
        await sb.start(SandboxSpec(limits=SandboxLimits(**limits)))
        r = await sb.exec(command, timeout_s=timeout_s)
        return {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "limit_hit": r.limit_hit}


async def terminal_bench_episode(task_dir: str, agent_command: str) -> dict[str, Any]:
    """The agent's one bash call, then the real verifier path (`TerminalBenchSession.score`)."""
    from miles_agent.envs.terminal_bench import TerminalBenchEnv
    from miles_agent.sandboxes.local import LocalSandbox

    env = TerminalBenchEnv(task_dir)
    task = env.tasks()[0]
    async with LocalSandbox() as sb:
        await sb.start(env.sandbox_spec(task))
        session = await env.open(task, sb)
        try:
            await session.call_tool("bash", {"command": agent_command})
            reward = await session.score([])
        finally:
            await session.close()
    return {"reward": reward.value, "parts": reward.parts}


def naive_episode(task_dir: str, agent_command: str) -> dict[str, Any]:
    """What a naive runner does: the agent's command, then test.sh in the same folder and home, with
    Harbor's /logs/verifier mapped into that folder (as the old workspace layout did)."""
    with tempfile.TemporaryDirectory(prefix="miles-attack-") as scratch:
        logs = os.path.join(scratch, "logs", "verifier")
        os.makedirs(logs)
        env = {"PATH": SYSTEM_PATH, "HOME": scratch}
        agent = subprocess.Popen(["bash", "-c", agent_command.replace("/logs/verifier", logs)], cwd=scratch,
                                 env=env, start_new_session=True)
        try:
            agent.wait(timeout=60)
            with open(os.path.join(task_dir, "tests", "test.sh")) as f:
                test_sh = f.read().replace("/logs/verifier", logs)
            subprocess.run(["bash", "-c", test_sh], cwd=scratch, env=env, timeout=60)
            return {"reward": _max_reward_within(os.path.join(logs, "reward.txt"), 2.0)}
        finally:
            try:
                os.killpg(agent.pid, 9)
            except ProcessLookupError:
                pass


def _max_reward_within(path: str, seconds: float) -> float:
    """The best reward a reader sees over ``seconds`` (what the agent's background processes do after
    the verifier counts too; a read may catch a file mid-rewrite)."""
    best, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                best = max(best, float(f.read().strip() or 0))
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    return best


def run_attack(request: dict[str, Any]) -> dict[str, Any]:
    """One attack as this process's user; ``key``: plant a kernel key of this user first."""
    keys = []
    if request.get("key"):
        keys = [add_key(request["key"], request["key_payload"], ring)
                for ring in (KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING)]
    try:
        timeout_s = request.get("timeout_s", 60.0)
        if request["mode"] == "episode":
            return asyncio.run(terminal_bench_episode(request["task_dir"], request["command"]))
        if request["mode"] == "naive_episode":
            return naive_episode(request["task_dir"], request["command"])
        if request["mode"] == "unsandboxed":
            return unsandboxed(request["command"], timeout_s)
        return asyncio.run(sandboxed(request["command"], timeout_s, request.get("limits", {})))
    finally:
        for key in keys:
            revoke_key(key)


if __name__ == "__main__":
    print(json.dumps(run_attack(json.loads(sys.argv[1]))))
