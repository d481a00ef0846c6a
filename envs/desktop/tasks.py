"""Desktop tasks in OSWorld's JSON shape, and their programmatic verifiers.

A task file is OSWorld's (``id``, ``instruction``, ``config`` steps, ``related_apps``, ``evaluator`` with
``func`` / ``result`` / ``expected``), read for the subset a sandboxed desktop can honour, plus one key of
ours, ``oracle``: the scripted solution (tool calls; a ``target`` names an accessibility node, resolved to
its on-screen centre when the oracle plays). Anything outside the subset is refused by name.

Config steps: ``launch`` {"command": [...]} starts an application in the desktop (``chromium`` /
``google-chrome`` with a URL: the browser, whose accessibility tree is observed); ``open`` {"path"} opens a
file in the text editor; ``execute`` / ``command`` {"command": [...] | str} runs before the desktop starts
(setup); ``file`` {"path", "content"} writes a file (ours: OSWorld downloads one); ``sleep`` {"seconds"}.

Evaluators: ``result`` is ``vm_file`` {"path"} (the file's text, "" when missing) or
``vm_command_line`` {"command"} (its stdout); ``func`` is ``exact_match`` (rules.expected, whitespace at
the ends ignored), ``check_include_exclude`` (rules.include / rules.exclude), ``check_json`` (the result
parsed as JSON; rules.expect: {key: value}, every pair equal) or ``check_text_lines`` (ours: rules.lines,
the file's non-blank lines exactly). A list of funcs is combined by ``conj`` ("and", the default, or "or").
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError

TASKS_DIR = Path(__file__).parent / "tasks"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
EDITOR = "mousepad"
CONFIG_TYPES = ("launch", "open", "execute", "command", "file", "sleep")
RESULT_TYPES = ("vm_file", "vm_command_line")
FUNCS = ("exact_match", "check_include_exclude", "check_json", "check_text_lines")


@dataclass(frozen=True)
class Check:
    func: str
    result: dict[str, Any]
    rules: dict[str, Any]


@dataclass(frozen=True)
class DesktopTask:
    id: str
    instruction: str
    launch: tuple[tuple[str, ...], ...]  # session launch items: ("browser", url) or an argv
    setup: tuple[str, ...]  # shell commands run before the desktop starts
    files: dict[str, bytes]
    checks: tuple[Check, ...]
    conj: str = "and"
    oracle: tuple[dict[str, Any], ...] = ()
    related_apps: tuple[str, ...] = ()
    webapp: bool = False
    sleep_s: float = 0.0
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def _bad(path: Path | str, what: str) -> UserError:
    return UserError(f"desktop task {path}: {what}")


def parse_task(data: dict[str, Any], where: Path | str = "<task>") -> DesktopTask:
    """One OSWorld-style task dict as a `DesktopTask`; a `UserError` naming the unsupported part."""
    for key in ("id", "instruction", "evaluator"):
        if key not in data:
            raise _bad(where, f"has no {key!r} (OSWorld task files have id, instruction, config, evaluator)")
    launch: list[tuple[str, ...]] = []
    setup: list[str] = []
    files: dict[str, bytes] = {}
    sleep_s = 0.0
    for step in data.get("config", []):
        kind, params = step.get("type"), step.get("parameters", {})
        if kind not in CONFIG_TYPES:
            raise _bad(where, f"config step type {kind!r} is not supported here; supported: {', '.join(CONFIG_TYPES)}")
        if kind == "launch":
            cmd = params.get("command")
            argv = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd or []]
            if not argv:
                raise _bad(where, "a launch step needs parameters.command")
            if argv[0] in BROWSERS:
                urls = [a for a in argv[1:] if not a.startswith("-")]
                launch.append(("browser", urls[0] if urls else "about:blank"))
            else:
                launch.append(tuple(argv))
        elif kind == "open":
            launch.append((EDITOR, str(params["path"])))
        elif kind in ("execute", "command"):
            cmd = params.get("command")
            setup.append(cmd if isinstance(cmd, str) else shlex.join(str(c) for c in cmd))
        elif kind == "file":
            files[str(params["path"])] = str(params.get("content", "")).encode()
        else:
            sleep_s += float(params.get("seconds", 1))
    ev = data["evaluator"]
    funcs = ev["func"] if isinstance(ev["func"], list) else [ev["func"]]
    results = ev["result"] if isinstance(ev["result"], list) else [ev["result"]] * len(funcs)
    expected = ev.get("expected", {})
    expected = expected if isinstance(expected, list) else [expected] * len(funcs)
    if not len(funcs) == len(results) == len(expected):
        raise _bad(where, "evaluator func, result and expected lists differ in length")
    checks = []
    for func, result, exp in zip(funcs, results, expected):
        if func not in FUNCS:
            raise _bad(where, f"evaluator func {func!r} is not supported here; supported: {', '.join(FUNCS)}")
        if result.get("type") not in RESULT_TYPES:
            raise _bad(where, f"evaluator result type {result.get('type')!r} is not supported; "
                              f"supported: {', '.join(RESULT_TYPES)}")
        if exp.get("type", "rule") != "rule":
            raise _bad(where, f"expected type {exp.get('type')!r} is not supported (only 'rule')")
        checks.append(Check(func, dict(result), dict(exp.get("rules", {}))))
    conj = ev.get("conj", "and")
    if conj not in ("and", "or"):
        raise _bad(where, f"evaluator conj {conj!r} must be 'and' or 'or'")
    urls = [item[1] for item in launch if item[0] == "browser"]
    return DesktopTask(
        id=str(data["id"]), instruction=str(data["instruction"]), launch=tuple(launch), setup=tuple(setup),
        files=files, checks=tuple(checks), conj=conj, oracle=tuple(data.get("oracle", ())),
        related_apps=tuple(data.get("related_apps", ())), sleep_s=sleep_s, source=str(data.get("source", "")),
        webapp=any(u.startswith("http://127.0.0.1:") or u.startswith("http://localhost:") for u in urls), raw=data)


def load_tasks(folder: str | Path | None = None) -> list[DesktopTask]:
    root = Path(folder) if folder else TASKS_DIR
    if not root.is_dir():
        raise UserError(f"desktop: task folder {root} does not exist; give env.options.tasks_dir a folder of "
                        "OSWorld-style task JSON files")
    tasks = []
    for path in sorted(root.glob("**/*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise _bad(path, f"is not valid JSON ({e})") from None
        tasks.append(parse_task(data, path))
    if not tasks:
        raise UserError(f"desktop: no task JSON files under {root}")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise UserError(f"desktop: duplicate task ids under {root}: "
                        f"{sorted({i for i in ids if ids.count(i) > 1})}")
    return tasks


def judge(check: Check, text: str) -> float:
    """One check of the evaluator on the result's text: 1.0 or 0.0."""
    rules = check.rules
    if check.func == "exact_match":
        return float(text.strip() == str(rules.get("expected", "")).strip())
    if check.func == "check_include_exclude":
        ok = all(s in text for s in rules.get("include", ())) and not any(s in text for s in rules.get("exclude", ()))
        return float(ok)
    if check.func == "check_text_lines":
        return float([ln.rstrip() for ln in text.splitlines() if ln.strip()] == list(rules.get("lines", ())))
    try:
        value = json.loads(text)
    except ValueError:
        return 0.0
    expect = rules.get("expect", {})
    if isinstance(expect, dict):
        return float(isinstance(value, dict) and all(value.get(k) == v for k, v in expect.items()))
    return float(value == expect)
