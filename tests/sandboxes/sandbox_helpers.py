"""Helpers for the local sandbox tests: run a coroutine, skip where bubblewrap cannot work, and look
for processes left on the host."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import pytest


def _bwrap_works() -> bool:
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return False
    probe = subprocess.run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True)
    return probe.returncode == 0


BWRAP_OK = _bwrap_works()
needs_bwrap = pytest.mark.skipif(not BWRAP_OK, reason="bubblewrap missing or cannot create namespaces here")


def run(coro):
    """Sync tests calling asyncio.run (no pytest-asyncio dependency)."""
    return asyncio.run(coro)


def live_processes_with(token: str) -> list[str]:
    """Host processes (not zombies) whose command line contains ``token``, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if token in cmdline and state != b"Z":
            found.append(f"{name}: {cmdline}")
    return found


def assert_nothing_left(token: str, within_s: float = 0.0) -> None:
    """No live host process carries ``token`` (after at most ``within_s`` for the kernel to reap)."""
    deadline = time.monotonic() + within_s
    while True:
        left = live_processes_with(token)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert not left, f"sandbox processes survived: {left}"
