"""Issue 13, class 4: host files pulled into the sandbox through symlinks in a downloaded task set.

Each attack plants a fake host secret (a random value, outside the task folder) and a task whose
environment/ file, Dockerfile COPY source, tests/ file, solution/ file or instruction.md reaches it
through a symlink: absolute, relative ``..``, a chain of links, or a linked folder. Every case first
proves that a naive stager (follow everything, as ``rglob`` + ``read_bytes`` does) copies the secret,
so the test cannot pass vacuously, then that loading the task set fails at once with a UserError
naming the link and the fix. Links that stay inside the task folder keep working.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from harbor_helpers import make_task

from miles_agent.envs.terminal_bench import (
    TaskFormatError,
    TaskSymlinkError,
    TerminalBenchEnv,
    harbor,
    load_task,
    load_tasks,
    staged_files,
)
from miles_agent.errors import UserError

FIX = "replace the link with a copy of the file inside the task folder"
COPYING_DOCKERFILE = "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data.txt /app/\nCOPY conf/ /app/conf/\n"


@pytest.fixture
def secret(tmp_path: Path) -> tuple[Path, bytes]:
    """A stand-in for ~/.ssh/id_rsa: a host file outside every task folder, with a value no task has."""
    value = f"HOST-SECRET-{secrets.token_hex(16)}".encode()
    path = tmp_path / "host-home" / ".ssh" / "id_rsa"
    path.parent.mkdir(parents=True)
    path.write_bytes(value)
    return path, value


def naive_stage(folder: Path) -> dict[Path, bytes]:
    """How a stager that trusts the task set reads it: every link followed on the host (file links as
    ``rglob`` + ``read_bytes`` do, folder links as ``shutil.copytree`` does)."""
    return {Path(d, f): Path(d, f).read_bytes() for d, _, names in os.walk(folder, followlinks=True)
            for f in names if Path(d, f).is_file()}


def plant_link(link: Path, target: Path, kind: str) -> None:
    """Make ``link`` reach ``target`` absolutely, relatively (``..``), or through a chain of two links."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if kind == "absolute":
        os.symlink(target, link)
    elif kind == "relative":
        os.symlink(os.path.relpath(target, link.parent), link)
    elif kind == "chain":  # link -> hop (inside the folder, harmless-looking) -> target (outside)
        hop = link.parent / f".{link.name}.hop"
        os.symlink(os.path.relpath(target, hop.parent), hop)
        os.symlink(hop.name, link)
    else:
        raise AssertionError(kind)


def task_with_solution(root: Path, dockerfile: str | None = None) -> Path:
    task = make_task(root, "evil", files={"solution/solve.sh": "echo solved\n", "environment/readme.txt": "hi\n"})
    if dockerfile is not None:
        (task / "environment" / "Dockerfile").write_text(dockerfile)
        (task / "environment" / "data.txt").write_text("data\n")
        (task / "environment" / "conf").mkdir()
        (task / "environment" / "conf" / "app.ini").write_text("[app]\n")
    return task


# (file planted as a link, whether the task has a Dockerfile that COPYs it)
PLACES = [
    ("environment/notes.txt", None),
    ("environment/data.txt", COPYING_DOCKERFILE),  # a COPY source file
    ("environment/conf/key.pem", COPYING_DOCKERFILE),  # a file inside a COPY source folder
    ("tests/helper.py", None),
    ("solution/answer.txt", None),
]


@pytest.mark.parametrize("kind", ["absolute", "relative", "chain"])
@pytest.mark.parametrize("place, dockerfile", PLACES)
def test_a_link_to_a_host_file_fails_the_load(tmp_path, secret, place, dockerfile, kind):
    secret_path, value = secret
    task = task_with_solution(tmp_path / "tasks", dockerfile)
    link = task / place
    link.unlink(missing_ok=True)
    plant_link(link, secret_path, kind)
    assert value in naive_stage(task).values(), "the detector must fire against a naive stager"

    with pytest.raises(UserError, match=FIX) as caught:
        load_task(task)
    message = str(caught.value)
    assert isinstance(caught.value, TaskSymlinkError)
    assert str(secret_path) in message and "outside the task folder" in message
    assert place.rsplit("/", 1)[-1] in message  # names the link (or, for a chain, its first hop)
    with pytest.raises(TaskSymlinkError):  # the environment refuses at construction, before any episode
        TerminalBenchEnv(tmp_path / "tasks")


def test_a_linked_folder_and_a_linked_instruction_fail_the_load(tmp_path, secret):
    secret_path, value = secret
    task = task_with_solution(tmp_path / "tasks")
    os.symlink(secret_path.parent, task / "environment" / "dotssh")  # a whole host folder
    assert value in naive_stage(task).values()
    with pytest.raises(TaskSymlinkError, match=rf"dotssh is a symlink to .*{FIX}"):
        load_tasks(tmp_path / "tasks")

    (task / "environment" / "dotssh").unlink()
    (task / "instruction.md").unlink()
    os.symlink(secret_path, task / "instruction.md")  # the prompt is logged with every trajectory
    with pytest.raises(TaskSymlinkError, match=r"instruction\.md is a symlink"):
        load_task(task)


def test_the_copy_planner_checks_links_on_its_own(tmp_path, secret):
    """`_workspace_files` is safe even without load_task's whole-folder check in front of it."""
    secret_path, value = secret
    task = task_with_solution(tmp_path / "tasks", COPYING_DOCKERFILE)
    (task / "environment" / "conf" / "app.ini").unlink()
    os.symlink(secret_path, task / "environment" / "conf" / "app.ini")
    plan = harbor.plan_dockerfile(COPYING_DOCKERFILE)
    with pytest.raises(TaskSymlinkError, match=r"app\.ini is a symlink"):
        harbor.image_files(task, plan, task / "task.toml")
    (task / "environment" / "data.txt").unlink()
    os.symlink(secret_path, task / "environment" / "data.txt")
    with pytest.raises(TaskSymlinkError, match=r"data\.txt is a symlink"):
        harbor.image_files(task, harbor.plan_dockerfile("COPY data.txt /app/\n"), task / "task.toml")


def test_staged_files_refuses_what_the_verifier_stager_would_follow(tmp_path, secret):
    """The walker the tests/ and solution/ installers use, on its own."""
    secret_path, value = secret
    task = task_with_solution(tmp_path / "tasks")
    plant_link(task / "tests" / "fixtures" / "expected.txt", secret_path, "relative")
    assert value in naive_stage(task / "tests").values()
    with pytest.raises(TaskSymlinkError, match=r"expected\.txt is a symlink to '\.\./"):
        staged_files(task / "tests", task)
    os.symlink(tmp_path / "nowhere", task / "solution" / "dangling")
    with pytest.raises(TaskSymlinkError, match=rf"dangling is a symlink to .*nowhere.*does not exist; {FIX}"):
        staged_files(task / "solution", task)
    os.symlink(secret_path.parent, task / "linked-tests")  # the folder itself a link out
    with pytest.raises(TaskSymlinkError, match="linked-tests is a symlink"):
        staged_files(task / "linked-tests", task)


def test_loops_and_special_files_are_refused(tmp_path):
    task = task_with_solution(tmp_path / "tasks")
    os.symlink("..", task / "environment" / "up")  # a folder link back to its own ancestor
    with pytest.raises(TaskSymlinkError, match="links back to its own folder"):
        load_task(task)
    (task / "environment" / "up").unlink()
    os.symlink("b", task / "environment" / "a")
    os.symlink("a", task / "environment" / "b")
    with pytest.raises(TaskSymlinkError, match="symlink loop"):
        load_task(task)
    (task / "environment" / "a").unlink()
    (task / "environment" / "b").unlink()
    os.mkfifo(task / "environment" / "pipe")  # read_bytes on it would hang the loader
    with pytest.raises(TaskFormatError, match="pipe is not a regular file"):
        load_task(task)


def test_links_inside_the_task_folder_still_work(tmp_path):
    task = task_with_solution(tmp_path / "tasks")
    shared = task / "shared"
    shared.mkdir()
    (shared / "words.txt").write_text("alpha\n")
    env_dir = task / "environment"
    os.symlink("readme.txt", env_dir / "alias.txt")  # a file link
    os.symlink("../shared", env_dir / "lib")  # a folder link to elsewhere in the task
    os.symlink("alias.txt", env_dir / "alias2.txt")  # a chain that stays inside
    os.symlink("../shared/words.txt", task / "tests" / "words.txt")

    t = load_task(task)
    assert sorted(t.files) == ["alias.txt", "alias2.txt", "lib/words.txt", "readme.txt"]
    assert all(p.is_relative_to(task.resolve()) and not p.is_symlink() for p in t.files.values())
    env = TerminalBenchEnv(tmp_path / "tasks")
    spec = env.sandbox_spec(env.tasks("all")[0])
    assert spec.files == {"alias.txt": b"hi\n", "alias2.txt": b"hi\n", "lib/words.txt": b"alpha\n",
                          "readme.txt": b"hi\n"}
    assert dict(staged_files(task / "tests", task)) == {"test.sh": (task / "tests" / "test.sh").resolve(),
                                                        "words.txt": (shared / "words.txt").resolve()}

    docker_task = task_with_solution(tmp_path / "tasks2", COPYING_DOCKERFILE)
    os.symlink("../readme.txt", docker_task / "environment" / "conf" / "readme.txt")
    assert sorted(load_task(docker_task).files) == ["conf/app.ini", "conf/readme.txt", "data.txt"]
