"""The offline verifier toolchain without an engine: which pins a task set asks for, how a setting
resolves, and what the verifier run carries (the real run is in test_terminal_bench_docker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_agent.envs.terminal_bench import TerminalBenchEnv
from miles_agent.envs.terminal_bench import verifier_toolchain as vt
from miles_agent.errors import UserError


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_pins_are_read_from_the_tasks_test_scripts(tmp_path):
    write(tmp_path / "a/tests/test.sh", "uv venv .v\nuv pip install pytest==8.4.1 'requests==2.32.3'\n"
                                        "echo numpy==9.9 > notes.txt\n")
    write(tmp_path / "b/tests/test.sh", "uvx -p 3.13 -w pytest==8.3.5 -w pytest-json-ctrf==0.3.5 pytest /tests\n"
                                        'uv add "pandas[perf]==2.2.3" scipy\n'
                                        "uv pip install \\\n  'shapely==2.1.1' \\\n  'timm==1.0.19'\n")
    assert vt.task_requirements(tmp_path) == ["pandas[perf]==2.2.3", "pytest-json-ctrf==0.3.5", "pytest==8.3.5",
                                              "pytest==8.4.1", "requests==2.32.3", "shapely==2.1.1", "timm==1.0.19"]


def fake_toolchain(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "uv").write_text("#!/bin/sh\n")
    (root / "wheels").mkdir()
    (root / "env").write_text(vt.ENV_SCRIPT)
    return root


def test_a_setting_resolves_to_a_prepared_folder_or_says_how_to_prepare_it(tmp_path, monkeypatch):
    assert vt.resolve("none") is None and vt.resolve(None) is None
    with pytest.raises(UserError, match="incomplete.*verifier_toolchain prepare --dest"):
        vt.resolve(str(tmp_path / "empty"))
    root = fake_toolchain(tmp_path / "tc")
    assert vt.resolve(str(root)).root == root
    monkeypatch.setattr(vt, "default_dest", lambda: tmp_path / "absent")
    assert vt.resolve("auto") is None  # not prepared: none, no error
    monkeypatch.setattr(vt, "default_dest", lambda: root)
    assert vt.resolve("auto").root == root


def test_the_verifier_run_mounts_the_toolchain_and_resolves_offline(tmp_path):
    from miles_agent.envs.terminal_bench.env import TerminalBenchSession

    root = fake_toolchain(tmp_path / "tc")
    write(tmp_path / "tasks/t/instruction.md", "x\n")
    write(tmp_path / "tasks/t/task.toml", 'version = "1.0"\n[verifier]\nenv = { UV_OFFLINE = "0" }\n')
    write(tmp_path / "tasks/t/tests/test.sh", "true\n")
    env = TerminalBenchEnv(tmp_path / "tasks", sandbox="docker", verifier_toolchain=str(root))
    session = TerminalBenchSession(env.harbor_task("t"), sandbox=None, command_timeout_s=1, max_output_chars=10,
                                   toolchain=env.toolchain)
    run = session.verifier_run()
    assert run.host_dirs == {vt.MOUNT: str(root)} and run.command.endswith("; bash /tests/test.sh")
    assert run.env["UV_FIND_LINKS"] == run.env["PIP_FIND_LINKS"] == f"{vt.MOUNT}/wheels"
    assert run.env["UV_PYTHON_DOWNLOADS"] == "never" and run.env["PIP_NO_INDEX"] == "1"
    assert run.env["UV_OFFLINE"] == "0"  # the task's own [verifier] env wins
    assert run.outputs == ("reward.json", "reward.txt")
    bare = TerminalBenchEnv(tmp_path / "tasks", sandbox="docker", verifier_toolchain="none")
    run = TerminalBenchSession(bare.harbor_task("t"), None, 1, 10, toolchain=bare.toolchain).verifier_run()
    assert run.host_dirs == {} and run.command == "bash /tests/test.sh"
