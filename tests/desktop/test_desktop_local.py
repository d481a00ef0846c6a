"""The desktop in the local (bubblewrap) sandbox: real Xvfb, chromium, xdotool; the verifier reads the web app.

Needs the host packages .ci/run installs (xvfb openbox stterm xdotool mousepad chromium); skipped, saying
which, without them.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from miles_agent.envs.desktop.actions import find_target
from miles_agent.envs.desktop.env import DesktopEnv
from miles_agent.sandboxes.local import LocalSandbox

TOOLS = ("Xvfb", "openbox", "stterm", "xdotool", "mousepad", "chromium", "bwrap")
missing = [t for t in TOOLS if not shutil.which(t)]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"apt-get install the desktop's packages (missing: {missing})")


def desktop_processes(marker: str) -> list[str]:
    """Host processes whose command line names this desktop's state folder (Xvfb's -fbdir among them)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(cmd)
    return found


async def episode(env: DesktopEnv, task_id: str, play):
    task = next(t for t in env.tasks() if t.id == task_id)
    sandbox = LocalSandbox()
    await sandbox.start(env.sandbox_spec(task))
    try:
        session = await env.open(task, sandbox)
        marker = session.desktop.state
        try:
            assert any("Xvfb" in c for c in desktop_processes(marker)), "the desktop runs inside this sandbox"
            await play(session)
            reward = await session.score([])
        finally:
            await session.close()
        return reward, session, marker
    finally:
        await sandbox.stop()


def test_a_click_at_the_buttons_coordinates_submits_the_form_and_nothing_leaks():
    env = DesktopEnv()

    async def fill_then_click(session):
        for name, text in (("Name", "Ada Lovelace"), ("Email", "ada@example.com"), ("Message", "Hello from the desktop")):
            x, y = find_target(session.last, {"role": "textbox", "name": name})
            await session.call_tool("click", {"x": x, "y": y})
            await session.call_tool("type", {"text": text})
        miss = await session.call_tool("click", {"x": 900, "y": 700})  # empty page: submits nothing
        assert "Send" in miss and 'value=\'Ada Lovelace\'' in miss
        assert (await session.sandbox.exec("test -e /var/lib/miles-webapp/contact.json")).exit_code != 0
        x, y = find_target(session.last, {"role": "button", "name": "Send"})
        after = await session.call_tool("click", {"x": x, "y": y})
        assert "Saved" in after  # the server's answer page

    reward, session, marker = asyncio.run(episode(env, "web-contact-form", fill_then_click))
    assert reward.value == 1.0
    assert session.screenshots and all(s[:8] == b"\x89PNG\r\n\x1a\n" for s in session.screenshots)
    assert desktop_processes(marker) == []  # Xvfb, chromium and the web app are gone with the session


def test_a_no_op_leaves_the_verifier_at_zero():
    async def nothing(session):
        pass

    reward, _, marker = asyncio.run(episode(DesktopEnv(), "web-contact-form", nothing))
    assert reward.value == 0.0 and desktop_processes(marker) == []


@pytest.mark.slow
@pytest.mark.parametrize("task_id", [t.id for t in DesktopEnv().tasks()])
def test_every_shipped_task_scores_one_with_its_oracle_and_zero_without(task_id):
    async def oracle(session):
        await session.play_oracle()

    async def nothing(session):
        pass

    env = DesktopEnv()
    assert asyncio.run(episode(env, task_id, oracle))[0].value == 1.0
    assert asyncio.run(episode(env, task_id, nothing))[0].value == 0.0
