"""Instances from a user's SWE-bench JSONL and local repositories (a git folder or a bundle); bad input
fails naming the line and field; patches that do not apply or touch what the tests stand on score 0."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from miles_agent.envs.swe import SWEEnv
from miles_agent.envs.swe.instance import load_instances
from miles_agent.errors import UserError

GIT = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t"}


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, env=GIT, check=True, capture_output=True, text=True).stdout


def diff(repo, files):
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    out = git(repo, "diff", "--cached")
    git(repo, "reset", "-q", "--hard")
    return out


@pytest.fixture
def dataset(tmp_path):
    """owner/proj: a bug in src/proj/core.py, and a later commit (the fix) that must not reach the sandbox."""
    repo = tmp_path / "repos" / "owner__proj"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "src/proj").mkdir(parents=True)
    (repo / "src/proj/core.py").write_text("def double(x):\n    return x + x + 1\n")
    (repo / "tests").mkdir()
    (repo / "tests/test_core.py").write_text("from proj.core import double\n\n\ndef test_zero_is_int():\n"
                                             "    assert isinstance(double(0), int)\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    gold = diff(repo, {"src/proj/core.py": "def double(x):\n    return x + x\n"})
    test_patch = diff(repo, {"tests/test_double.py": "from proj.core import double\n\n\n"
                                                     "def test_double():\n    assert double(3) == 6\n"})
    (repo / "src/proj/core.py").write_text("def double(x):\n    return 2 * x\n")
    git(repo, "commit", "-qam", "the fix, later")
    row = {"instance_id": "owner__proj-1", "repo": "owner/proj", "base_commit": base, "patch": gold,
           "problem_statement": "double(3) is 7", "test_patch": test_patch,
           "FAIL_TO_PASS": json.dumps(["tests/test_double.py::test_double"]),  # SWE-bench's string form
           "PASS_TO_PASS": ["tests/test_core.py::test_zero_is_int"], "environment_setup": {"pythonpath": ["src"]}}
    (tmp_path / "instances.jsonl").write_text(json.dumps(row) + "\n")
    return tmp_path, row


def test_a_users_instance_scores_gold_one_and_empty_zero(dataset):
    root, row = dataset
    env = SWEEnv(root)  # --tasks: instances.jsonl and repos/
    (task,) = env.tasks("train")
    assert "double(3) is 7" in task.messages[0]["content"]
    gold = asyncio.run(env.score_patch(task.id, row["patch"]))
    empty = asyncio.run(env.score_patch(task.id, ""))
    assert (gold.reward.value, empty.reward.value) == (1.0, 0.0), (gold.reason, empty.reason)
    assert empty.tests == {"tests/test_double.py::test_double": "failed", "tests/test_core.py::test_zero_is_int": "passed"}


def test_a_bundle_works_as_the_repository_and_carries_only_the_base(dataset, tmp_path):
    root, row = dataset
    repo = root / "repos" / "owner__proj"
    git(repo, "bundle", "create", str(root / "repos" / "owner__proj.bundle"), "--all")
    subprocess.run(["rm", "-rf", str(repo)], check=True)
    env = SWEEnv(instances=root / "instances.jsonl")
    (tmp_path / "b.bundle").write_bytes(env.repos.bundle("owner/proj", row["base_commit"]))
    assert git(tmp_path, "bundle", "list-heads", str(tmp_path / "b.bundle")).split() == [row["base_commit"],
                                                                                       "refs/heads/base"]
    assert asyncio.run(env.score_patch("owner__proj-1", row["patch"])).reward.value == 1.0


def test_patches_that_fail_or_touch_the_tests_score_zero(dataset):
    root, row = dataset
    env = SWEEnv(root)
    bad = asyncio.run(env.score_patch("owner__proj-1", row["patch"].replace("x + x + 1", "x * 3 - 9")))
    assert bad.reward.value == 0.0 and bad.reward.parts["patch_applied"] == 0.0 and "does not apply" in bad.reason
    forged = row["patch"] + ("diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
                             "+++ b/conftest.py\n@@ -0,0 +1 @@\n+x = 1\n")
    v = asyncio.run(env.score_patch("owner__proj-1", forged))
    assert v.reward.value == 0.0 and "conftest.py" in v.reason


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pop("test_patch"), "lacks test_patch"),
    (lambda r: r.update(FAIL_TO_PASS="not json"), "FAIL_TO_PASS is a string but not a JSON list"),
    (lambda r: r.update(FAIL_TO_PASS=[]), "FAIL_TO_PASS is empty"),
    (lambda r: r.update(base_commit="main"), "not a git commit id"),
    (lambda r: r.update(environment_setup={"image": "x", "cmds": []}), "unknown keys"),
])
def test_bad_instances_name_the_line_and_field(dataset, change, message):
    root, row = dataset
    change(row)
    (root / "instances.jsonl").write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError, match=message) as e:
        load_instances(root / "instances.jsonl")
    assert "instances.jsonl:2" in str(e.value)


def test_a_missing_repository_says_where_it_looked(dataset):
    root, _ = dataset
    subprocess.run(["rm", "-rf", str(root / "repos" / "owner__proj")], check=True)
    with pytest.raises(UserError, match="owner__proj/ .*or owner__proj.bundle"):
        SWEEnv(root).sandbox_spec(SWEEnv(root).tasks()[0])


def test_an_instance_with_an_image_is_left_out_on_the_local_sandbox(dataset):
    root, row = dataset
    row["environment_setup"]["image"] = "python:3.11"
    (root / "instances.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match="need their image: use env.sandbox=docker"):
        SWEEnv(root).tasks()
    assert [t.id for t in SWEEnv(root, sandbox="docker").tasks()] == ["owner__proj-1"]
