"""terminal-bench without a sandbox: the Harbor reader, its error messages, and the pure helpers.

Why these cases: a malformed task must fail at load time with the file and the fix named (not as a
zero reward mid-run), and the container/local split decides which tasks may touch the host at all.
"""

from __future__ import annotations

import asyncio

import pytest
from harbor_helpers import HOST_PYTHON_IMAGE, make_task

from miles_agent.environment import ToolError
from miles_agent.envs.terminal_bench import (
    SHIPPED_TASKS,
    TaskFormatError,
    TerminalBenchEnv,
    load_task,
    load_tasks,
)
from miles_agent.envs.terminal_bench.env import _format_output, _parse_reward
from miles_agent.envs.terminal_bench.harbor import PYTHON_SHIM
from miles_agent.errors import UserError
from miles_agent.sandbox import ExecResult


def test_shipped_set_is_graded_and_complete():
    tasks = load_tasks(SHIPPED_TASKS)
    local = [t for t in tasks if not t.needs_container]
    assert len(local) >= 20
    assert {t.difficulty for t in local} == {"easy", "medium", "hard"}
    assert all(t.has_solution and t.instruction and t.verifier_timeout_s <= 60 for t in tasks)
    container = [t for t in tasks if t.needs_container]
    assert [t.name for t in container] == ["container-redis-counter"]
    assert "needs-container-image" in container[0].tags


def test_env_lists_local_tasks_and_reports_the_container_one():
    env = TerminalBenchEnv()
    ids = {t.id for t in env.tasks()}
    assert "hello-file" in ids and "container-redis-counter" not in ids
    assert "container sandbox" in env.excluded["container-redis-counter"]
    assert TerminalBenchEnv(sandbox="docker").excluded == {}
    task = next(t for t in env.tasks() if t.id == "append-line")
    assert task.messages[0]["role"] == "user" and "log.txt" in task.messages[0]["content"]
    assert task.info["difficulty"] == "easy"
    spec = env.sandbox_spec(task)
    assert spec.image is None and spec.files == {"log.txt": b"started\nloading\nrunning\n"}
    assert spec.limits.wall_time_s == 120.0
    redis = env.harbor_task("container-redis-counter")
    docker_env = TerminalBenchEnv(sandbox="docker")
    spec = docker_env.sandbox_spec(next(t for t in docker_env.tasks() if t.id == redis.name))
    assert spec.image is None and spec.build.context == str(redis.path / "environment") and spec.files == {}
    assert (spec.workdir, spec.cpus, spec.network) == (None, 1.0, False)  # the built image's WORKDIR decides
    assert spec.limits.memory_bytes == 1024 << 20


def test_open_refuses_a_container_task_on_the_local_sandbox():
    class Local:
        name = "local"

    env = TerminalBenchEnv(sandbox="docker")
    task = next(t for t in env.tasks() if t.id == "container-redis-counter")
    with pytest.raises(UserError, match="needs its own container image.*container sandbox"):
        asyncio.run(env.open(task, Local()))  # type: ignore[arg-type]
    with pytest.raises(UserError, match="needs a sandbox"):
        asyncio.run(env.open(task, None))


def test_only_container_tasks_is_a_clear_error(tmp_path):
    make_task(tmp_path, "img", toml='[environment]\ndocker_image = "ubuntu:24.04"\n')
    with pytest.raises(UserError, match="need their own container image; configure a container sandbox"):
        TerminalBenchEnv(tmp_path).tasks()


@pytest.mark.parametrize("kwargs, match", [
    ({"toml": None}, r"task\.toml is missing"),
    ({"toml": "version = \n"}, r"task\.toml is not valid TOML .*line 1"),
    ({"toml": "[verifier]\ntimeout_sec = -5\n"}, r"\[verifier\] timeout_sec must be a positive number"),
    ({"toml": '[agent]\ntimeout_sec = "long"\n'}, r"\[agent\] timeout_sec must be a positive number"),
    ({"toml": 'verifier = "x"\n'}, r"\[verifier\] must be a table"),
    ({"toml": "[metadata]\ntags = \"a\"\n"}, r"tags must be a list of strings"),
    ({"toml": "[environment]\nmemory = \"lots\"\n"}, r"memory = 'lots' is not a size"),
    ({"toml": "[environment]\ndocker_image = 3\n"}, r"docker_image must be an image name"),
    ({"toml": "[verifier]\nenv = [1]\n"}, r"\[verifier\] env must be a table of strings"),
    ({"instruction": None}, r"instruction\.md is missing; write the task's prompt"),
    ({"instruction": "  \n"}, r"instruction\.md is empty"),
    ({"test_sh": None}, r"tests/test\.sh is missing; the verifier must write"),
    ({"files": {"environment/Dockerfile": "FROM x\nWORKDIR /app\nCOPY missing.txt .\n"}}, r"COPY source 'missing\.txt'"),
])
def test_malformed_task_names_file_and_fix(tmp_path, kwargs, match):
    d = make_task(tmp_path, **kwargs)
    with pytest.raises(TaskFormatError, match=match) as e:
        load_task(d)
    assert str(tmp_path) in str(e.value)


def test_folder_errors(tmp_path):
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_tasks(tmp_path / "nope")
    with pytest.raises(TaskFormatError, match="holds no task directories"):
        load_tasks(tmp_path)
    old = tmp_path / "tb1"
    old.mkdir()
    (old / "task.yaml").write_text("instruction: x\n")
    with pytest.raises(TaskFormatError, match="Terminal-Bench 1 format"):
        load_tasks(tmp_path)
    with pytest.raises(TaskFormatError):  # a TaskFormatError is a UserError: the CLI prints one line
        raise TaskFormatError("x")


def test_new_schema_metadata_memory_splits_and_single_task_dir(tmp_path):
    d = make_task(tmp_path, toml=(
        'schema_version = "1.1"\nsplit = "test"\n[task]\nname = "org/t"\nkeywords = ["k"]\n'
        '[metadata]\ndifficulty = "hard"\ncategory = "c"\n[verifier]\ntimeout_sec = 5\nenv = { A = 1 }\n'
        '[agent]\ntimeout_sec = 7.5\n[environment]\nmemory = "512M"\nenv = { B = "b" }\n'))
    t = load_task(d)
    assert (t.difficulty, t.category, t.tags, t.split) == ("hard", "c", ("k",), "test")
    assert (t.verifier_timeout_s, t.agent_timeout_s, t.memory_mb) == (5.0, 7.5, 512)
    assert t.verifier_env == {"A": "1"} and t.env == {"B": "b"} and not t.needs_container
    assert [x.name for x in load_tasks(d)] == ["t"]  # a single task directory is accepted too
    env = TerminalBenchEnv(d)
    assert [x.id for x in env.tasks("test")] == ["t"] and [x.id for x in env.tasks("all")] == ["t"]
    with pytest.raises(UserError, match="no task .* split 'train'; its splits are: test"):
        env.tasks("train")


def test_dockerfile_with_only_files_runs_locally_with_workdir_mapped(tmp_path):
    d = make_task(tmp_path, files={
        "environment/Dockerfile": (f"# a comment\nFROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\nENV MODE=fast \\\n"
                                   "    OTHER=1\nCOPY data/ ./data/\nCOPY run.sh /app/bin/run.sh\n"),
        "environment/data/a.txt": "a", "environment/run.sh": "echo", "environment/unused.txt": "u"})
    t = load_task(d)
    assert not t.needs_container and t.workdir == "/app"
    assert sorted(set(t.files) - {PYTHON_SHIM}) == ["bin/run.sh", "data/a.txt"]
    assert {k: v for k, v in t.env.items() if k != "PATH"} == {"MODE": "fast", "OTHER": "1"}
    d2 = make_task(tmp_path, "t2", files={"environment/Dockerfile": "FROM ubuntu\nRUN apt-get install -y jq && make\n"})
    assert "apt-get" in load_task(d2).container_reasons[0]
    d3 = make_task(tmp_path, "t3", files={"environment/Dockerfile": "FROM ubuntu\nWORKDIR /app\nCOPY x /etc/x\n",
                                          "environment/x": "x"})
    assert "/etc/x (a read-only system folder" in load_task(d3).container_reasons[0]
    d4 = make_task(tmp_path, "t4", files={"environment/docker-compose.yaml": "services: {}\n",
                                          "environment/f.txt": "f"})
    t4 = load_task(d4)
    assert "services" in t4.container_reasons[0] and list(t4.files) == ["f.txt"]


@pytest.mark.parametrize("kind, body, want", [
    ("txt", "1\n", (1.0, {})), ("txt", " 0.5 ", (0.5, {})), ("txt", "", None), ("txt", "yes", None),
    ("txt", "nan", None), ("json", '{"reward": 1, "style": 0.5}', (1.0, {"style": 0.5})),
    ("json", '{"acc": 0.25}', (0.25, {})), ("json", '{"a": 1, "b": 0}', (0.5, {"a": 1.0, "b": 0.0, "reward_dimensions": 2.0})),
    ("json", "[1]", None), ("json", "{", None), ("json", '{"reward": 1, "note": "ok"}', None),
    ("json", '{"reward": true}', None), ("json", "{}", None),
])
def test_parse_reward(kind, body, want):
    assert _parse_reward(kind, body) == want


def test_tool_output_is_capped_and_marked():
    r = ExecResult(exit_code=2, stdout="a" * 100 + "z" * 100, stderr="", duration_s=1.0)
    out = _format_output(r, 50)
    assert out.startswith("a" * 25) and "characters cut" in out and out.endswith("[exit code: 2]")
    r = ExecResult(exit_code=137, stdout="", stderr="", duration_s=3.0, timed_out=True)
    assert "timed out after 3s" in _format_output(r, 50)


def test_bash_tool_rejects_bad_calls():
    from miles_agent.envs.terminal_bench import TerminalBenchSession

    env = TerminalBenchEnv()
    session = TerminalBenchSession(env.harbor_task("hello-file"), None, 10.0, 100)  # type: ignore[arg-type]
    assert [t["function"]["name"] for t in session.tools] == ["bash"]
    with pytest.raises(ToolError, match="only tool is bash"):
        asyncio.run(session.call_tool("python", {"command": "ls"}))
    for args in ({}, {"command": 3}, {"command": "  "}):
        with pytest.raises(ToolError, match='"command"'):
            asyncio.run(session.call_tool("bash", args))
