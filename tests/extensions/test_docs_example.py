"""docs/extensions.md's example module and commands run as written (with a smaller rollout)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from miles_agent.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "extensions.md"
TINY = ["model.warm_start=null", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "env.max_new_tokens_per_turn=8", "env.max_turns=1"]


def doc_example() -> tuple[str, list[list[str]]]:
    """The ``# myext.py`` block, and the arguments of each ``PYTHONPATH=$DIR miles-agent ...`` command."""
    text = DOC.read_text()
    module = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# myext.py"))
    bash = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "myext:" in b)
    lines = [line for line in bash.replace("\\\n", " ").splitlines() if line.startswith("PYTHONPATH=")]
    return module, [shlex.split(line)[2:] for line in lines]


def test_the_documented_module_plugs_in_with_the_documented_commands(tmp_path, monkeypatch):
    module, commands = doc_example()
    (tmp_path / "myext.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert len(commands) == 2 and all(c[0] == "train" for c in commands)
    try:
        for i, args in enumerate(commands):
            run = tmp_path / f"run{i}"
            args = [a for a in args if a not in ("--steps", "2")]  # the run's length is this test's
            assert main([args[0], "--no-progress", "--steps", "1", "--run-dir", str(run), *args[1:], *TINY]) == 0
            (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert record["episodes"] == 4
            if i == 0:  # every key of the first command was used
                assert "hooks/longest" in record and "hooks/grad_norm_x2" in record
                assert json.loads((run / "hooks_final.json").read_text()) == {"hooks/checkpointed": 1,
                                                                             "hooks/trained_steps": 1}
                assert (run / "print_sink.txt").read_text().split()[0] == "0"
                assert (run / "tensorboard").is_dir() and "reward/tool_calls_seen" in record
    finally:
        sys.modules.pop("myext", None)
