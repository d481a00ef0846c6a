"""The shipped instances: small Python libraries with real bugs, made into git repositories from sources
kept in the project (``instances/<library>/``).

Each library folder holds the correct code and its visible tests; ``bugs/<name>.toml`` holds one bug:
the issue text, the hidden test file, and ``[[change]]`` entries (a ``fixed`` snippet of a file and the
``buggy`` text it becomes). For each bug the base commit is the library with the bug (a root commit of
its own branch, so no history shows the fix), the gold ``patch`` is the diff to the correct library,
the ``test_patch`` adds ``tests/test_issue_<name>.py``; FAIL_TO_PASS are that file's tests, PASS_TO_PASS
the library's visible ones. Commits carry fixed names and dates, so every build gives the same commit
ids. Built once into the cache (keyed by a hash of the sources) and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import tomllib
from pathlib import Path

from miles_agent.errors import UserError

from .instance import git

SOURCES = Path(__file__).parent / "instances"
OWNER = "miles-swe"
_TEST = re.compile(r"^def (test_\w+)\(", re.M)
_GIT_ENV = {"GIT_AUTHOR_NAME": "miles-agent", "GIT_AUTHOR_EMAIL": "swe@miles.invalid",
            "GIT_COMMITTER_NAME": "miles-agent", "GIT_COMMITTER_EMAIL": "swe@miles.invalid",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
GITIGNORE = "__pycache__/\n*.pyc\n.pytest_cache/\n"


def _library_files(lib: Path) -> dict[str, str]:
    files = {p.relative_to(lib).as_posix(): p.read_text() for p in sorted(lib.rglob("*"))
             if p.is_file() and p.relative_to(lib).parts[0] != "bugs" and "__pycache__" not in p.parts}
    return {**files, ".gitignore": GITIGNORE}


def _sources_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(SOURCES.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(SOURCES).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _buggy(files: dict[str, str], changes: list[dict[str, str]], where: Path) -> dict[str, str]:
    out = dict(files)
    for change in changes:
        path, fixed, buggy = change["file"], change["fixed"], change["buggy"]
        if out.get(path, "").count(fixed) != 1:
            raise UserError(f"swe: {where}: the `fixed` snippet must occur exactly once in {path}")
        out[path] = out[path].replace(fixed, buggy)
    return out


def _instance(lib: Path, bug: Path, repo: Path) -> dict:
    spec = tomllib.loads(bug.read_text())
    name, visible = bug.stem, _library_files(lib)
    env = {**os.environ, **_GIT_ENV}
    run = lambda *args: git(*args, cwd=repo, env=env)  # noqa: E731
    run("checkout", "-q", "--orphan", f"bug/{name}")
    run("rm", "-rq", "--cached", "--ignore-unmatch", ".")
    for child in repo.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    _write_tree(repo, _buggy(visible, spec["change"], bug))
    run("add", "-A")
    run("commit", "-q", "-m", f"{lib.name}: state before issue {name}")
    base = run("rev-parse", "HEAD").strip()
    _write_tree(repo, visible)
    run("add", "-A")
    patch = run("diff", "--cached", "--binary", "HEAD")
    run("reset", "-q", "--hard", "HEAD")
    hidden = f"tests/test_issue_{name.replace('-', '_')}.py"
    _write_tree(repo, {hidden: spec["hidden_test"].lstrip("\n")})
    run("add", "-A")
    test_patch = run("diff", "--cached", "--binary", "HEAD")
    run("reset", "-q", "--hard", "HEAD")
    p2p = [f"{rel}::{t}" for rel, text in sorted(visible.items()) if rel.startswith("tests/")
           for t in _TEST.findall(text)]
    return {"instance_id": f"{OWNER}__{lib.name}-{name}", "repo": f"{OWNER}/{lib.name}", "base_commit": base,
            "problem_statement": spec["issue"].strip() + "\n", "patch": patch, "test_patch": test_patch,
            "FAIL_TO_PASS": [f"{hidden}::{t}" for t in _TEST.findall(spec["hidden_test"])],
            "PASS_TO_PASS": p2p, "environment_setup": {"pythonpath": ["."]}, "hints_text": "",
            "created_at": "2026-01-01T00:00:00Z"}


def build(dest: Path) -> Path:
    """Write ``dest/instances.jsonl`` and ``dest/repos/miles-swe__<library>/``; returns the JSONL path."""
    rows = []
    for lib in sorted(p for p in SOURCES.iterdir() if (p / "bugs").is_dir()):
        repo = dest / "repos" / f"{OWNER}__{lib.name}"
        repo.mkdir(parents=True)
        git("-c", "init.defaultBranch=main", "init", "-q", str(repo), env={**os.environ, **_GIT_ENV})
        rows += [_instance(lib, bug, repo) for bug in sorted((lib / "bugs").glob("*.toml"))]
    path = dest / "instances.jsonl"
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path


def build_shipped(cache: Path | None = None) -> tuple[Path, Path]:
    """(instances.jsonl, repos folder) of the shipped instances, built once into the cache."""
    root = cache or Path(os.environ.get("MILES_AGENT_CACHE", "~/.cache/miles-agent")).expanduser() / "swe"
    out = root / f"shipped-{_sources_hash()}"
    if not (out / "instances.jsonl").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            build(tmp)
            try:
                tmp.rename(out)
            except OSError:  # another process built it first
                if not (out / "instances.jsonl").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out / "instances.jsonl", out / "repos"
