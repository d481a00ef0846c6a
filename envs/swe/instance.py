"""SWE-bench-format instances: one JSON object a line, and the local repositories they name.

Fields (SWE-bench's): ``instance_id``, ``repo`` ("owner/name"), ``base_commit``, ``problem_statement``,
``test_patch``, ``patch`` (the gold fix, optional), ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (pytest node ids,
as a JSON list or, as SWE-bench's dataset stores them, a string holding one), ``hints_text`` and
``environment_setup_commit`` (kept, unused). Ours: ``environment_setup``, an object with ``image`` (the
container image the tests need; none: only host tools, so the local sandbox can run it), ``commands``
(shell lines run in the checked-out repository before the agent and again before the tests, e.g. an
offline ``pip install -e .``), ``pythonpath`` (folders of the repository on the tests' import path,
default ``["."]``) and ``test_timeout_s``; and optionally ``split``.

Repositories: ``repos_dir/owner__name`` (a git repository) or ``repos_dir/owner__name.bundle`` (a git
bundle). Only the history up to ``base_commit`` reaches the sandbox, as SWE-bench's images keep it: the
fix that followed is never in the agent's ``git log``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS",
            "PASS_TO_PASS")
_SHA = re.compile(r"[0-9a-f]{7,40}")
_DIFF_PATHS = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


@dataclass(frozen=True)
class Instance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    patch: str = ""
    image: str | None = None
    commands: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = (".",)
    test_timeout_s: float = 300.0
    split: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def test_files(self) -> list[str]:
        """The files the tests live in (the part of each node id before ``::``), in order, once each."""
        return list(dict.fromkeys(t.split("::")[0] for t in (*self.fail_to_pass, *self.pass_to_pass)))


def patch_paths(patch: str) -> set[str]:
    """Every path a unified git diff touches (old and new names)."""
    return {p for pair in _DIFF_PATHS.findall(patch) for p in pair}


def _test_ids(value: Any, key: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):  # SWE-bench's dataset keeps the list JSON-encoded in a string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise UserError(f"{where}: {key} is a string but not a JSON list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
        raise UserError(f"{where}: {key} must be a list of pytest node ids (e.g. [\"tests/test_x.py::test_y\"])")
    return tuple(value)


def parse_instance(row: Any, where: str) -> Instance:
    if not isinstance(row, dict):
        raise UserError(f"{where}: an instance is a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise UserError(f"{where}: instance lacks {', '.join(missing)} (SWE-bench's fields: {', '.join(REQUIRED)})")
    for key in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
        if not isinstance(row[key], str) or not row[key].strip():
            raise UserError(f"{where}: {key} must be a non-empty string")
    if not _SHA.fullmatch(row["base_commit"]):
        raise UserError(f"{where}: base_commit {row['base_commit']!r} is not a git commit id (hex)")
    f2p = _test_ids(row["FAIL_TO_PASS"], "FAIL_TO_PASS", where)
    if not f2p:
        raise UserError(f"{where}: FAIL_TO_PASS is empty: an instance needs at least one test the fix makes pass")
    setup = row.get("environment_setup") or {}
    if not isinstance(setup, dict):
        raise UserError(f"{where}: environment_setup must be an object (image, commands, pythonpath, test_timeout_s)")
    unknown = set(setup) - {"image", "commands", "pythonpath", "test_timeout_s"}
    if unknown:
        raise UserError(f"{where}: environment_setup has unknown keys {sorted(unknown)}; "
                        "known: image, commands, pythonpath, test_timeout_s")
    commands, pythonpath = setup.get("commands", []), setup.get("pythonpath", ["."])
    if not (isinstance(commands, list) and all(isinstance(c, str) for c in commands)):
        raise UserError(f"{where}: environment_setup.commands must be a list of shell commands")
    if not (isinstance(pythonpath, list) and all(isinstance(p, str) and not p.startswith("/") for p in pythonpath)):
        raise UserError(f"{where}: environment_setup.pythonpath must be a list of folders inside the repository")
    known = {*REQUIRED, "patch", "environment_setup", "split"}
    return Instance(instance_id=row["instance_id"], repo=row["repo"], base_commit=row["base_commit"],
                    problem_statement=row["problem_statement"], test_patch=row["test_patch"], fail_to_pass=f2p,
                    pass_to_pass=_test_ids(row["PASS_TO_PASS"], "PASS_TO_PASS", where), patch=row.get("patch") or "",
                    image=setup.get("image") or None, commands=tuple(commands), pythonpath=tuple(pythonpath),
                    test_timeout_s=float(setup.get("test_timeout_s", 300.0)), split=row.get("split"),
                    extra={k: v for k, v in row.items() if k not in known})


def load_instances(path: Path) -> list[Instance]:
    if not path.is_file():
        raise UserError(f"swe: instances file {path} does not exist; point env.options.instances at a JSONL file")
    out, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg}); the file holds one instance object a line") from None
        inst = parse_instance(row, where)
        if inst.instance_id in seen:
            raise UserError(f"{where}: instance_id {inst.instance_id!r} appears twice")
        seen.add(inst.instance_id)
        out.append(inst)
    if not out:
        raise UserError(f"swe: {path} holds no instance")
    return out


class Repositories:
    """Git bundles of the base commits, made once per (repo, commit) from ``repos_dir``."""

    def __init__(self, repos_dir: Path) -> None:
        self.repos_dir = repos_dir
        self._bundles: dict[tuple[str, str], bytes] = {}

    def source(self, repo: str) -> Path:
        name = repo.replace("/", "__")
        for candidate in (self.repos_dir / name, self.repos_dir / f"{name}.bundle"):
            if candidate.exists():
                return candidate
        raise UserError(f"swe: repository {repo!r} is not in {self.repos_dir}: expected {name}/ (a git "
                        f"repository) or {name}.bundle; set env.options.repos to the folder that holds it")

    def bundle(self, repo: str, commit: str) -> bytes:
        """A bundle with one branch, ``base``, at ``commit``, and only its history."""
        key = (repo, commit)
        if key not in self._bundles:
            self._bundles[key] = _make_bundle(self.source(repo), commit, repo)
        return self._bundles[key]


def git(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    if shutil.which("git") is None:
        raise UserError("swe: the git command is needed on this machine to read the repositories; install git")
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"swe: git {' '.join(args[:3])} failed: {done.stderr.strip()[-300:]}")
    return done.stdout


def _make_bundle(source: Path, commit: str, repo: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="miles-swe-") as tmp:
        bare = Path(tmp) / "bare.git"
        git("init", "-q", "--bare", str(bare))
        # Every ref of the source (a repository or a bundle), then one branch at the commit: the bundle
        # made from that branch alone holds only the commit's history.
        git("fetch", "-q", "--no-tags", str(source.resolve()), "+refs/*:refs/source/*", cwd=bare)
        try:
            git("update-ref", "refs/heads/base", f"{commit}^{{commit}}", cwd=bare)
        except UserError as e:
            raise UserError(f"swe: {repo}: base_commit {commit} is not in {source} ({e})") from None
        git("bundle", "create", "-q", str(Path(tmp) / "repo.bundle"), "refs/heads/base", cwd=bare)
        return (Path(tmp) / "repo.bundle").read_bytes()
