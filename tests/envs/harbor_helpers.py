"""Writing Harbor task folders for the terminal-bench tests."""

from __future__ import annotations

from pathlib import Path

from miles_agent.envs.terminal_bench.harbor import host_python_version

TEST_SH = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
# A python:* image the local sandbox stands in for (its python3's version), and one it cannot (any other).
HOST_PYTHON_IMAGE = f"python:{host_python_version()}-slim"
OTHER_PYTHON = "3.13" if host_python_version() != "3.13" else "3.12"


def make_task(root: Path, name: str = "t", toml: str = 'version = "1.0"\n', instruction: str = "Do it.",
              test_sh: str | None = TEST_SH, files: dict[str, str] | None = None) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    if toml is not None:
        (d / "task.toml").write_text(toml)
    if instruction is not None:
        (d / "instruction.md").write_text(instruction)
    if test_sh is not None:
        (d / "tests" / "test.sh").write_text(test_sh)
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d
