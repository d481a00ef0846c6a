"""The desktop in the docker backend on the real engine: the env's own image (envs/desktop/image, built by
the backend with apt-get), every shipped task's scripted oracle scores 1.0 and a no-op 0.0.

Needs the container engine .ci/container-engine.sh starts (MILES_AGENT_DOCKER_TEST_URL) and the Debian
mirrors for the image's one build (chromium and the X applications: a few minutes, then cached by the
engine). The whole task list is nightly (slow); the first build alone is minutes, which CI does not pay.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("docker")

from miles_agent.envs.desktop.env import DesktopEnv  # noqa: E402
from miles_agent.sandboxes.docker import DockerSandbox, connect  # noqa: E402

URL = os.environ.get("MILES_AGENT_DOCKER_TEST_URL")
# The first test builds the image (apt-get of chromium and the X applications: minutes on a loaded machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(not URL, reason="no container engine: source .ci/container-engine.sh up")]
TASK_IDS = [t.id for t in DesktopEnv().tasks()]


async def episode(env: DesktopEnv, task_id: str, play) -> tuple[float, dict]:
    task = next(t for t in env.tasks() if t.id == task_id)
    sandbox = DockerSandbox(base_url=URL)
    await sandbox.start(env.sandbox_spec(task))
    try:
        session = await env.open(task, sandbox)
        try:
            await play(session)
            reward = await session.score([])
        finally:
            await session.close()
        assert session.screenshots and session.screenshots[-1][:8] == b"\x89PNG\r\n\x1a\n"
        return reward.value, reward.parts
    finally:
        await sandbox.stop()


async def oracle(session) -> None:
    await session.play_oracle()


async def nothing(session) -> None:
    pass


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_every_shipped_task_scores_one_with_its_oracle_and_zero_without_on_docker(task_id):
    env = DesktopEnv(sandbox="docker")
    assert asyncio.run(episode(env, task_id, oracle))[0] == 1.0
    assert asyncio.run(episode(env, task_id, nothing))[0] == 0.0


def test_the_desktop_leaves_no_container_behind():
    seen: list[str] = []

    async def note_container(session) -> None:
        seen.append(session.sandbox.handle_id)
        assert connect(URL).containers(filters={"id": seen[0]})  # running while the episode plays

    asyncio.run(episode(DesktopEnv(sandbox="docker"), TASK_IDS[0], note_container))
    assert seen and not connect(URL).containers(all=True, filters={"id": seen[0]})
