"""The starter family: generated one-command shell tasks in Harbor format, the curriculum a laptop model learns on.

The 24 hand-written tasks are out of reach for a tiny model trained for minutes on a CPU, so
``env.options.family=starter`` plays a generated family instead: twelve kinds of file chores (sort, dedupe,
count, head, tail, join, grep, upper-case, reverse, clean up, make executable, back up) over files whose
contents are drawn at random. Each is a real Harbor task folder -- instruction.md, task.toml with its split,
environment/ files, solution/solve.sh and tests/test.sh with the expected result -- written once to a cache
folder and then loaded, run and verified as any other task (the local sandbox, the verifier's reward.txt).
The family is the one terminal-bench's built-in warm start is made on (`TerminalBenchEnv.warm_start_options`):
its ``sft`` split holds the demonstrations, ``train`` the RL tasks, ``eval`` and ``test`` held-out ones.

Solving one takes two model turns: the kind's command in a ``<bash>`` block, then a reply without a
command once its output came back. The file names are fixed per kind and the shell does the work on
the contents, so the model never copies text from the instruction: the 0.8M-parameter tiny model did not
learn to copy names and words in 200 SFT steps (0 of 64 held-out commands exact; it learned the kinds'
command shapes in 100), as it could not copy digits in arith-tools. What it must learn is which command
an instruction asks for, and to run it rather than claim the work is done: the demonstrator
(`StarterDemonstrator`) is lazy at rate ``1 - tool_rate`` and says "Done." without running anything -- the
habit the warm start keeps and RL has to remove.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_agent.engine import Completion, FinishReason, SamplingParams

FAMILY_VERSION = 2
SPLIT_SIZES = {"sft": 1536, "train": 512, "eval": 64, "test": 64}
SPLIT_SEEDS = {"sft": 3, "train": 0, "eval": 1, "test": 2}
WORDS = ("ant", "bee", "cat", "cow", "dog", "elk", "fox", "owl", "pig", "ram", "yak", "emu",
         "fig", "kiwi", "lime", "pear", "plum", "date", "corn", "bean", "rice", "oat",
         "red", "blue", "gold", "gray", "pink", "jade", "ruby", "onyx", "sky", "sun",
         "moon", "star", "rain", "snow", "wind", "fog", "ice", "sea")
DONE_REPLY = "Done."

_TOML = """version = "1.0"
split = "{split}"

[metadata]
difficulty = "easy"
category = "starter"
tags = ["starter", "{kind}"]

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 60.0
"""
_TEST = """#!/bin/bash
# Verifier of a starter task: 1 in /logs/verifier/reward.txt when the check holds, else 0.
mkdir -p /logs/verifier
if {check}; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@dataclass(frozen=True)
class StarterTask:
    """One generated task: its kind, its files at the start, and the verifier's check (expected files go to tests/)."""

    kind: str
    files: dict[str, str]
    expected: dict[str, str]  # tests/<name> holds the content a result file must have
    check: str


@dataclass(frozen=True)
class Kind:
    """A kind of chore: its instruction, the one command that does it, and how to draw a task of it."""

    instruction: str
    command: str
    make: Callable[[random.Random], tuple[dict[str, str], dict[str, str], str]]


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _words(rng: random.Random, low: int = 3, high: int = 6) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(low, high))]


def _result(source: str, target: str, lines: list[str], result: list[str]) -> tuple[dict, dict, str]:
    """``source`` holds ``lines``; ``target`` must end up holding ``result`` and ``source`` be unchanged."""
    return ({source: _text(lines)}, {target: _text(result), source: _text(lines)},
            f"cmp -s {target} /tests/{target} && cmp -s {source} /tests/{source}")


def _grep(rng: random.Random) -> tuple[dict, dict, str]:
    lines = [f"{rng.choice(('error', 'info', 'warn'))} {rng.choice(WORDS)}" for _ in range(rng.randint(3, 7))]
    lines[rng.randrange(len(lines))] = f"error {rng.choice(WORDS)}"
    return _result("log.txt", "errors.txt", lines, [line for line in lines if "error" in line])


def _join(rng: random.Random) -> tuple[dict, dict, str]:
    a, b = _words(rng, 2, 4), _words(rng, 2, 4)
    return ({"a.txt": _text(a), "b.txt": _text(b)}, {"all.txt": _text(a + b)}, "cmp -s all.txt /tests/all.txt")


def _names(rng: random.Random, suffixes: tuple[str, ...], low: int, high: int) -> list[str]:
    return [f"{w}{rng.choice(suffixes)}" for w in rng.sample(WORDS, rng.randint(low, high))]


def _cleanup(rng: random.Random) -> tuple[dict, dict, str]:
    tmp, keep = _names(rng, (".tmp",), 1, 4), [f"{w}.txt" for w in rng.sample(WORDS, 2)]
    files = {name: _text([rng.choice(WORDS)]) for name in tmp + keep}
    return files, {}, " && ".join([f"[ ! -e {n} ]" for n in tmp] + [f"[ -f {n} ]" for n in keep])


def _executable(rng: random.Random) -> tuple[dict, dict, str]:
    scripts = [f"{w}.sh" for w in rng.sample(WORDS, rng.randint(1, 3))]
    files = {name: f"#!/bin/bash\necho {rng.choice(WORDS)}\n" for name in scripts}
    return files, {}, " && ".join(f"[ -x {n} ]" for n in scripts)


def _backup(rng: random.Random) -> tuple[dict, dict, str]:
    lines = _words(rng)
    return ({"notes.txt": _text(lines)}, {"notes.txt": _text(lines)},
            "cmp -s backup/notes.txt /tests/notes.txt && cmp -s notes.txt /tests/notes.txt")


def _count(rng: random.Random) -> tuple[dict, dict, str]:
    lines = _words(rng, 2, 9)
    return {"data.txt": _text(lines)}, {}, f'[ "$(tr -d " " < count.txt)" = {len(lines)} ]'


KINDS: dict[str, Kind] = {
    "sort": Kind("Sort the lines of `names.txt` into `sorted.txt`.", "sort names.txt > sorted.txt",
                 lambda rng: _result("names.txt", "sorted.txt", ws := _words(rng), sorted(ws))),
    "dedupe": Kind("Write the distinct lines of `words.txt`, sorted, into `unique.txt`.", "sort -u words.txt > unique.txt",
                   lambda rng: _result("words.txt", "unique.txt", ws := _words(rng, 4, 8), sorted(set(ws)))),
    "count": Kind("Write the number of lines of `data.txt` into `count.txt`.", "wc -l < data.txt > count.txt", _count),
    "head": Kind("Put the first line of `log.txt` into `first.txt`.", "head -n 1 log.txt > first.txt",
                 lambda rng: _result("log.txt", "first.txt", ws := _words(rng), ws[:1])),
    "tail": Kind("Put the last line of `log.txt` into `last.txt`.", "tail -n 1 log.txt > last.txt",
                 lambda rng: _result("log.txt", "last.txt", ws := _words(rng), ws[-1:])),
    "join": Kind("Join `a.txt` and then `b.txt` into `all.txt`.", "cat a.txt b.txt > all.txt", _join),
    "grep": Kind("Put the lines of `log.txt` that contain `error` into `errors.txt`.", "grep error log.txt > errors.txt",
                 _grep),
    "upper": Kind("Write `word.txt` in upper case into `upper.txt`.", "tr a-z A-Z < word.txt > upper.txt",
                  lambda rng: _result("word.txt", "upper.txt", ws := _words(rng, 1, 3), [w.upper() for w in ws])),
    "reverse": Kind("Write the lines of `list.txt` in reverse order into `reversed.txt`.", "tac list.txt > reversed.txt",
                    lambda rng: _result("list.txt", "reversed.txt", ws := _words(rng), ws[::-1])),
    "cleanup": Kind("Delete every `.tmp` file in this directory.", "rm -f *.tmp", _cleanup),
    "executable": Kind("Make every `.sh` file in this directory executable.", "chmod +x *.sh", _executable),
    "backup": Kind("Copy `notes.txt` into a new directory named `backup`.", "mkdir -p backup && cp notes.txt backup/",
                   _backup),
}


def make_task(rng: random.Random) -> StarterTask:
    kind = rng.choice(sorted(KINDS))
    files, expected, check = KINDS[kind].make(rng)
    return StarterTask(kind, files, expected, check)


def split_tasks(split: str) -> list[tuple[str, StarterTask]]:
    """(task name, task) of one split, the same on every machine."""
    rng = random.Random(1000 + SPLIT_SEEDS[split])
    out = []
    for i in range(SPLIT_SIZES[split]):
        task = make_task(rng)
        out.append((f"starter-{split}-{i:04d}-{task.kind}", task))
    return out


def _write_task(folder: Path, split: str, task: StarterTask) -> None:
    kind = KINDS[task.kind]
    (folder / "tests").mkdir(parents=True)
    (folder / "solution").mkdir()
    (folder / "instruction.md").write_text(kind.instruction + "\n")
    (folder / "task.toml").write_text(_TOML.format(split=split, kind=task.kind))
    (folder / "solution" / "solve.sh").write_text(f"#!/bin/bash\nset -euo pipefail\n{kind.command}\n")
    (folder / "tests" / "test.sh").write_text(_TEST.format(check=task.check))
    for name, text in task.expected.items():
        (folder / "tests" / name).write_text(text)
    for rel, text in task.files.items():
        path = folder / "environment" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def family_dir() -> Path:
    """The family's task folders, written once per version (atomically: a half-written folder is never used)."""
    root = Path(os.environ.get("MILES_AGENT_CACHE", "~/.cache/miles-agent")).expanduser()
    out = root / f"terminal-bench-starter-v{FAMILY_VERSION}"
    if (out / ".complete").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".starter-", dir=root))
    try:
        for split in SPLIT_SIZES:
            for name, task in split_tasks(split):
                _write_task(tmp / name, split, task)
        (tmp / ".complete").write_text(f"{sum(SPLIT_SIZES.values())} tasks\n")
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: use its copy
            if not (out / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- the demonstrator -----------------------------------------------------------------------------

def command_for(instruction: str) -> str | None:
    """The one command that does a starter task, read from its instruction (None: not a starter task)."""
    text = instruction.strip()
    return next((kind.command for kind in KINDS.values() if kind.instruction == text), None)


class StarterDemonstrator:
    """A scripted `Policy` for the starter family, through the terminal harness: ``<bash>COMMAND</bash>``,
    then ``Done.`` once the output came back; or, at rate ``1 - tool_rate``, ``Done.`` at once (lazy)."""

    def __init__(self, tokenizer: Any, tool_rate: float = 1.0, seed: int = 0) -> None:
        self.tokenizer, self.tool_rate = tokenizer, tool_rate
        self.rng = random.Random(seed)  # one draw per episode, in the order episodes start

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        turns = self.tokenizer.decode(input_ids).split("<|im_start|>user")
        command = command_for(turns[1].split("<|im_end|>")[0]) if len(turns) > 1 else None
        if command is None:
            raise ValueError("the starter demonstrator plays only starter-family tasks (env.options.family=starter)")
        if len(turns) > 2:  # the command's output came back
            reply = DONE_REPLY
        else:
            reply = DONE_REPLY if self.rng.random() >= self.tool_rate else f"<bash>{command}</bash>"
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_new_tokens]
        finish = FinishReason.STOP if ids[-1] == self.tokenizer.eos_token_id else FinishReason.LENGTH
        return Completion(output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason=finish,
                          weight_version=0, prompt_tokens=len(input_ids))
