"""The Harbor adapter's local environment (envs/external/harbor_plugins.py) and symlinks (issue 13).

The host side copies into and out of the trial root, which is the agent's filesystem: a link the agent
made there (``/tests -> /etc``) must not turn Harbor's upload of tests/ into a write on the host, nor a
download into a read of a host file; a link in the downloaded task folder must not copy a host file in.
Each attack first runs against the naive copy (what the provider did before) to prove it fires. Harbor
itself needs Python 3.12 and its own venv, so its three base classes are stubbed here; the provider's
file handling is all ours.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import secrets
import shutil
import sys
import types
from pathlib import Path

import pytest

FIX = "replace the link with a copy of the file inside the task folder"


@pytest.fixture
def plugins(monkeypatch):
    class ExecResult:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    stubs = {"harbor.agents.base": {"BaseAgent": object}, "harbor.agents.capabilities": {"AgentCapabilities": dict},
             "harbor.environments.base": {"BaseEnvironment": object, "ExecResult": ExecResult},
             "harbor.models.agent.context": {"AgentContext": object}}
    for name in ("harbor", "harbor.agents", "harbor.environments", "harbor.models", "harbor.models.agent"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "miles_agent.envs.external.harbor_plugins", raising=False)
    yield importlib.import_module("miles_agent.envs.external.harbor_plugins")
    sys.modules.pop("miles_agent.envs.external.harbor_plugins", None)


@pytest.fixture
def host(tmp_path):
    """A host folder standing in for /etc (writable target) and a secret in it."""
    d = tmp_path / "host-etc"
    d.mkdir()
    value = f"HOST-SECRET-{secrets.token_hex(16)}"
    (d / "shadow").write_text(value)
    return d, value


@pytest.fixture
def task(tmp_path):
    d = tmp_path / "task"
    (d / "tests").mkdir(parents=True)
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (d / "environment").mkdir()
    (d / "environment" / "data.txt").write_text("data\n")
    return d


def started(plugins, task: Path):
    env = plugins.LocalEnvironment()
    env.environment_dir = task / "environment"
    asyncio.run(env.start(False))
    return env


def test_an_agent_link_does_not_turn_the_verifier_upload_into_a_host_write(plugins, task, host):
    host_dir, _ = host
    naive = started(plugins, task)
    os.symlink(host_dir, naive._path("/tests"))  # what the agent does, as root in the sandbox
    shutil.copytree(task / "tests", naive._path("/tests"), dirs_exist_ok=True)  # the old upload_dir
    assert (host_dir / "test.sh").exists(), "the detector must fire against the naive upload"
    (host_dir / "test.sh").unlink()

    env = started(plugins, task)
    os.symlink(host_dir, env._path("/tests"))
    asyncio.run(env.upload_dir(task / "tests", "/tests"))
    assert sorted(os.listdir(host_dir)) == ["shadow"]
    assert not env._path("/tests").is_symlink() and env._path("/tests/test.sh").read_text().startswith("echo 1")

    os.symlink(host_dir, env._path("/logs/verifier/up"))  # a linked folder above the file
    with pytest.raises(PermissionError, match="leads out of the sandbox"):
        asyncio.run(env.upload_file(task / "tests" / "test.sh", "/logs/verifier/up/test.sh"))
    os.symlink(host_dir / "shadow", env._path("/logs/verifier/reward.txt"))  # the file itself a link
    asyncio.run(env.upload_file(task / "tests" / "test.sh", "/logs/verifier/reward.txt"))
    assert sorted(os.listdir(host_dir)) == ["shadow"] and "echo 1" not in (host_dir / "shadow").read_text()
    asyncio.run(env.stop(True))
    asyncio.run(naive.stop(True))


def test_an_agent_link_does_not_turn_a_download_into_a_host_read(plugins, task, host, tmp_path):
    host_dir, value = host
    env = started(plugins, task)
    os.symlink(host_dir / "shadow", env._path("/logs/agent/out.txt"))
    shutil.copy2(env._path("/logs/agent/out.txt"), tmp_path / "naive.txt")  # the old download_file
    assert (tmp_path / "naive.txt").read_text() == value, "the detector must fire against the naive download"

    with pytest.raises(PermissionError, match="is a symlink in the sandbox"):
        asyncio.run(env.download_file("/logs/agent/out.txt", tmp_path / "got.txt"))
    (env._path("/logs/agent/real.txt")).write_text("agent log\n")
    asyncio.run(env.download_dir("/logs", tmp_path / "logs"))
    got = {p.relative_to(tmp_path / "logs").as_posix(): p for p in (tmp_path / "logs").rglob("*") if p.is_file()}
    assert list(got) == ["agent/real.txt"] and not any(p.is_symlink() for p in (tmp_path / "logs").rglob("*"))
    os.symlink(host_dir, env._path("/logs/agent/etc"))
    with pytest.raises(PermissionError, match="leads out of the sandbox"):
        asyncio.run(env.download_file("/logs/agent/etc/shadow", tmp_path / "x"))
    asyncio.run(env.stop(True))


def test_a_task_folder_link_to_a_host_file_is_refused(plugins, task, host):
    host_dir, value = host
    os.symlink(host_dir / "shadow", task / "tests" / "expected.txt")
    naive = started(plugins, task)
    shutil.copytree(task / "tests", naive._path("/tests"), dirs_exist_ok=True)
    assert naive._path("/tests/expected.txt").read_text() == value, "the detector must fire"

    env = started(plugins, task)
    with pytest.raises(PermissionError, match=rf"expected\.txt is a symlink .*{FIX}"):
        asyncio.run(env.upload_dir(task / "tests", "/tests"))
    assert not env._path("/tests/expected.txt").exists()
    os.symlink(host_dir, task / "environment" / "etc")  # a linked folder in environment/, at start
    with pytest.raises(PermissionError, match=FIX):
        started(plugins, task)
    asyncio.run(env.stop(True))
    asyncio.run(naive.stop(True))


def test_links_inside_the_task_folder_are_copied_as_their_content(plugins, task):
    (task / "tests" / "fixtures").mkdir()
    (task / "tests" / "fixtures" / "a.txt").write_text("A\n")
    os.symlink("fixtures/a.txt", task / "tests" / "alias.txt")
    os.symlink("fixtures", task / "tests" / "more")
    env = started(plugins, task)
    asyncio.run(env.upload_dir(task / "tests", "/tests"))
    for rel in ("fixtures/a.txt", "alias.txt", "more/a.txt"):
        path = env._path(f"/tests/{rel}")
        assert path.read_text() == "A\n" and not path.is_symlink()
    assert env._path("/app/data.txt").read_text() == "data\n"
    os.symlink("..", task / "tests" / "fixtures" / "up")
    with pytest.raises(PermissionError, match="a loop"):
        asyncio.run(env.upload_dir(task / "tests", "/tests2"))
    asyncio.run(env.stop(True))
