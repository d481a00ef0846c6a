"""The side-car protocol, without any third-party package: concurrent requests matched by id, a
package that prints on stdout cannot corrupt the stream, errors and crashes come back named."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from miles_agent.envs.external.process import SideCar, SideCarError, list_tasks
from miles_agent.envs.external.venv import find_python
from miles_agent.errors import UserError

ADAPTER = '''
import asyncio, os, sys
print("noise on stdout")  # a chatty package
async def tasks(config):
    return [{"id": str(i), "prompt": [], "info": {}} for i in range(config["n"])]
async def episode(config, task_id, base_url, api_key, delay=0.0):
    print("more noise")
    if task_id == "boom":
        raise ValueError("bad task")
    if task_id == "die":
        os._exit(3)
    await asyncio.sleep(delay)
    return {"reward": float(task_id), "parts": {"key_len": len(api_key)}, "info": base_url}
'''


@pytest.fixture
def adapter(tmp_path) -> Path:
    path = tmp_path / "toy_side.py"
    path.write_text(ADAPTER)
    return path


def test_list_tasks_ignores_package_stdout(adapter):
    assert [t["id"] for t in list_tasks(Path(sys.executable), adapter, {"n": 3})] == ["0", "1", "2"]


def test_concurrent_episodes_answer_by_id_and_errors_are_named(adapter):
    async def main():
        side = SideCar(Path(sys.executable), adapter, {"n": 1})
        await side.start()
        try:
            slow = side.call("episode", 10, task_id="2", base_url="u", api_key="abc", delay=0.3)
            fast = side.call("episode", 10, task_id="1", base_url="u", api_key="abcd")
            results = await asyncio.gather(slow, fast)
            with pytest.raises(SideCarError, match="ValueError: bad task"):
                await side.call("episode", 10, task_id="boom", base_url="u", api_key="k")
            with pytest.raises(SideCarError, match="exited with code 3"):
                await side.call("episode", 10, task_id="die", base_url="u", api_key="k")
            return results
        finally:
            await side.close()

    slow, fast = asyncio.run(main())
    assert slow == {"reward": 2.0, "parts": {"key_len": 3}, "info": "u"}
    assert fast == {"reward": 1.0, "parts": {"key_len": 4}, "info": "u"}


def test_missing_python_is_a_user_error_with_the_fix():
    with pytest.raises(UserError, match="pyenv install 2.1"):
        find_python("2.1")
