"""The aci commands themselves (run here in-process; in an episode they run in the sandbox)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from miles_agent.harnesses import aci_runtime as rt
from miles_agent.harnesses.aci import RUNTIME, runtime_command


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/m.py").write_text("def f(x):\n    return x + 1\n\n\ndef g():\n    return f(1)\n")
    (tmp_path / "notes.txt").write_text("f is here\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git/x.py").write_text("def f(): pass\n")
    return tmp_path


def test_view_windows_and_lists(repo, monkeypatch):
    monkeypatch.setattr(rt, "WINDOW", 2)
    out = rt.view("pkg/m.py")
    assert out.splitlines() == ["[pkg/m.py: 6 lines, showing 1-2; 4 more below (view from line 3)]",
                                "1| def f(x):", "2|     return x + 1"]
    assert rt.view(".").splitlines() == ["[folder .: 2 entries]", "notes.txt", "pkg/"]
    with pytest.raises(rt.Refused, match="has 6 lines"):
        rt.view("pkg/m.py", start=9)


def test_search_in_file_and_repo_skips_git(repo):
    assert rt.search("def f").splitlines() == ["[1 matches for 'def f' in .]", "pkg/m.py:1: def f(x):"]
    assert "notes.txt:1: f is here" in rt.search("f is", "notes.txt")
    assert rt.search("nothing") == "no match for 'nothing' in ."


def test_edit_replaces_a_range_and_inserts(repo):
    rt.edit("pkg/m.py", 2, 2, "    return x + 2")
    rt.edit("pkg/m.py", 1, 0, "import os")
    assert (repo / "pkg/m.py").read_text().splitlines()[:3] == ["import os", "def f(x):", "    return x + 2"]


def test_a_broken_python_edit_is_refused_and_the_file_unchanged(repo):
    before = (repo / "pkg/m.py").read_text()
    with pytest.raises(rt.Refused, match="does not parse"):
        rt.edit("pkg/m.py", 2, 2, "  return (x +")
    with pytest.raises(rt.Refused, match="does not parse"):
        rt.replace("pkg/m.py", "    return f(1)", "return f(1)\n  x")
    with pytest.raises(rt.Refused, match="not created"):
        rt.create("pkg/new.py", "def (:\n")
    assert (repo / "pkg/m.py").read_text() == before and not (repo / "pkg/new.py").exists()
    rt.edit("notes.txt", 1, 1, "no syntax to check (")  # not Python: no check
    assert (repo / "notes.txt").read_text() == "no syntax to check (\n"


def test_replace_needs_exactly_one_occurrence(repo):
    with pytest.raises(rt.Refused, match="occurs 2 times"):
        rt.replace("pkg/m.py", "return", "yield")
    with pytest.raises(rt.Refused, match="occurs 0 times"):
        rt.replace("pkg/m.py", "absent", "x")
    assert "[pkg/m.py edited; lines 3-6 now read]" in rt.replace("pkg/m.py", "f(1)", "f(2)")


def test_the_command_the_sandbox_runs(repo):
    """The source sent through bash is this module; the call arrives as base64 JSON."""
    cmd = runtime_command("view", {"path": "pkg/m.py", "start": 5})
    payload = cmd.rsplit(" ", 1)[1]
    assert json.loads(base64.b64decode(payload)) == {"op": "view", "path": "pkg/m.py", "start": 5}
    done = subprocess.run([sys.executable, "-c", RUNTIME, payload], capture_output=True, text=True)
    assert done.returncode == 0 and "5| def g():" in done.stdout
    bad = base64.b64encode(json.dumps({"op": "view", "path": "absent.py"}).encode()).decode()
    done = subprocess.run([sys.executable, "-c", RUNTIME, bad], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout.startswith("error: no file absent.py")
    assert runtime_command("run_tests", {"args": "tests/t.py"}) == "python3 -m pytest -q -p no:cacheprovider tests/t.py"
