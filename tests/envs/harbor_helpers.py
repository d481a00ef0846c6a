"""Writing Harbor task folders for the terminal-bench tests."""

from __future__ import annotations

from pathlib import Path

TEST_SH = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"


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
