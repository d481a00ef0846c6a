"""Harbor tasks shaped like public Terminal-Bench ones, run through the real local sandbox unmodified.

Why: public tasks scored 0.000 under their own oracle here because the sandbox rewrote their paths,
took ``ENV PATH=...:${PATH}`` literally and sent any RUN line or compose file to a container. Each
test is one such class: the task's scripts must run as Harbor runs them (paths at their real place,
Docker's ENV semantics, RUN steps in order), and what needs a container must say why.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harbor_helpers import HOST_PYTHON_IMAGE, OTHER_PYTHON, make_task

from miles_agent.envs.terminal_bench import TerminalBenchEnv
from miles_agent.envs.terminal_bench.dockerfile import expand, plan_dockerfile, run_reason
from miles_agent.envs.terminal_bench.env import LocalSetupError
from miles_agent.envs.terminal_bench.harbor import PYTHON_SHIM, host_python_version, load_task

local = pytest.importorskip("miles_agent.sandboxes.local", reason="the local sandbox is not installed")
REPO = Path(__file__).resolve().parents[2]

# A verifier in the shape Terminal-Bench's tests take: computed paths, a reward file, an exit code.
CHECK = """#!/bin/bash
APP_DIR="${APP_DIR:-/app}"
ok=1
%s
if [ $ok = 1 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; exit 1; fi
"""


def check(*conditions: str) -> str:
    return CHECK % "\n".join(f"{c} || {{ echo 'FAILED: {c}'; ok=0; }}" for c in conditions)


async def oracle_and_noop(tasks_dir: Path, name: str, **options) -> tuple[float, float, str]:
    """The oracle's reward, the untouched start's reward, and the oracle verifier's output."""
    env = TerminalBenchEnv(tasks_dir, **options)
    task = next(t for t in env.tasks("all") if t.id == name)
    out = []
    for oracle in (True, False):
        sandbox = local.LocalSandbox()
        await sandbox.start(env.sandbox_spec(task))
        try:
            session = await env.open(task, sandbox)
            if oracle:
                solved = await env.oracle_solve(task, sandbox)
                assert solved.exit_code == 0, solved.stdout + solved.stderr
            reward = await session.score([])
            out.append((reward.value, session.verifier_result.stdout if session.verifier_result else ""))
        finally:
            await sandbox.stop()
    return out[0][0], out[1][0], out[0][1]


def test_computed_paths_and_the_real_workdir(tmp_path):
    """``APP_DIR="${APP_DIR:-/app}"`` and ``$(dirname "$0")`` only work where /app, /tests and /solution
    really are: nothing in the scripts is rewritten."""
    make_task(tmp_path, "paths", files={
        "environment/Dockerfile": f"FROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\nCOPY input.txt /app/input.txt\n",
        "environment/input.txt": "3\n4\n",
        "solution/solve.sh": ('#!/bin/bash\nHERE="$(cd "$(dirname "$0")" && pwd)"\nAPP_DIR="${APP_DIR:-/app}"\n'
                              '[ "$HERE" = /solution ] && [ "$PWD" = /app ] || exit 3\n'
                              'paste -sd+ "$APP_DIR/input.txt" | bc > "$APP_DIR/sum.txt"\n'),
    }, test_sh=check('[ "$PWD" = /app ]', '[ "$(cat "$APP_DIR/sum.txt")" = 7 ]',
                     '[ "$(cd "$(dirname "$0")" && pwd)" = /tests ]', '[ ! -e /workspace ]'))
    assert asyncio.run(oracle_and_noop(tmp_path, "paths"))[:2] == (1.0, 0.0)


def test_env_path_is_expanded_against_the_base_image(tmp_path):
    """``ENV PATH="/opt/tool/bin:${PATH}"`` keeps the system PATH (rm, cat still found), and a COPY to
    an absolute path outside the WORKDIR lands there."""
    make_task(tmp_path, "envpath", files={
        "environment/Dockerfile": (f'FROM {HOST_PYTHON_IMAGE}\nENV TOOL_HOME=/opt/tool\n'
                                   'ENV PATH="${TOOL_HOME}/bin:${PATH}" GREETING=${UNSET:-hello}\n'
                                   "WORKDIR /app\nCOPY greet /opt/tool/bin/greet\n"),
        "environment/greet": "#!/bin/sh\necho \"$GREETING from $0\"\n",
        "solution/solve.sh": "#!/bin/bash\nrm -f stale\ngreet > out.txt\n",
    }, test_sh=check('[ "$(cat /app/out.txt)" = "hello from /opt/tool/bin/greet" ]',
                     'case "$PATH" in /opt/tool/bin:/usr/local/sbin:*) true;; *) false;; esac'))
    (tmp_path / "envpath" / "environment" / "greet").chmod(0o755)  # COPY keeps the mode, as git checks it out
    t = load_task(tmp_path / "envpath")
    assert t.env["PATH"].startswith("/opt/tool/bin:/usr/local/sbin:/usr/local/bin:") and t.env["GREETING"] == "hello"
    assert t.files.keys() - {PYTHON_SHIM} == {"/opt/tool/bin/greet"} and not t.needs_container
    assert asyncio.run(oracle_and_noop(tmp_path, "envpath"))[:2] == (1.0, 0.0)


def test_a_verifier_imports_the_agents_package_from_the_workdir(tmp_path):
    """Real tests run ``python3 -m pkg`` from /app to exercise the agent's own code. By default the
    verifier's Python has no cwd on sys.path (an agent's json.py must not pass the tests), so such a task
    fails; ``verifier_safe_path=False`` gives it Harbor's behaviour."""
    make_task(tmp_path, "pkg", files={
        "environment/Dockerfile": f"FROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\n",
        "solution/solve.sh": ("#!/bin/bash\nmkdir -p reconciler\n"
                              "printf 'print(6 * 7)\\n' > reconciler/__main__.py\n"),
    }, test_sh=check('cd /app', '[ "$(python3 -m reconciler)" = 42 ]'))
    assert asyncio.run(oracle_and_noop(tmp_path, "pkg"))[:2] == (0.0, 0.0)
    assert asyncio.run(oracle_and_noop(tmp_path, "pkg", verifier_safe_path=False))[:2] == (1.0, 0.0)


@pytest.mark.parametrize("text, env, want", [
    ("$A/x", {"A": "1"}, ["1/x"]), ("${A}y", {"A": "1"}, ["1y"]), ("${B:-d}", {}, ["d"]),
    ("${B:-d}", {"B": ""}, ["d"]), ("${B-d}", {"B": ""}, [""]), ("${A:+set}", {"A": "1"}, ["set"]),
    ("${B:+set}", {}, [""]), ("'$A'", {"A": "1"}, ["$A"]), ("\\$A", {"A": "1"}, ["$A"]),
    ('"a b" c=$A', {"A": "1"}, ["a b", "c=1"]), ("${B:-${A}2}", {"A": "1"}, ["12"]),
])
def test_docker_word_expansion(text, env, want):
    assert expand(text, env, split=True) == want


def test_run_steps_run_locally_in_order_with_their_env_and_workdir(tmp_path):
    make_task(tmp_path, "runs", files={
        "environment/Dockerfile": (
            "FROM ubuntu:24.04\nARG NAME=world\nRUN mkdir -p /data && echo \"hello $NAME\" > /data/greeting\n"
            "WORKDIR /srv\nWORKDIR app\nCOPY seed.tar.gz /tmp/seed.tar.gz\n"
            "RUN tar -xzf /tmp/seed.tar.gz && rm /tmp/seed.tar.gz && cp /data/greeting ./greeting \\\n"
            "    && chmod 600 ./greeting && ln -s /data data\n"
            "ENV LATE=1\nRUN [\"sh\", \"-c\", \"echo late=$LATE > /data/late\"]\n"),
        "solution/solve.sh": "#!/bin/bash\ncat greeting seed/a.txt > joined.txt\n",
    }, test_sh=check('[ "$PWD" = /srv/app ]', '[ "$(cat joined.txt)" = "$(printf "hello world\\nA")" ]',
                     '[ "$(stat -c %a greeting)" = 600 ]', '[ "$(cat /data/late)" = late=1 ]', '[ -L data ]'))
    seed = tmp_path.parent / f"{tmp_path.name}-seed"
    (seed / "seed").mkdir(parents=True)
    (seed / "seed" / "a.txt").write_text("A\n")
    subprocess.run(["tar", "-czf", str(tmp_path / "runs" / "environment" / "seed.tar.gz"), "-C", str(seed), "seed"],
                   check=True)
    t = load_task(tmp_path / "runs")
    assert not t.needs_container, t.container_reasons
    assert [s.workdir for s in t.setup] == ["/", "/srv/app", "/srv/app"] and t.workdir == "/srv/app"
    assert t.setup[0].env == {"NAME": "world"} and t.setup[2].env["LATE"] == "1"
    assert asyncio.run(oracle_and_noop(tmp_path, "runs"))[:2] == (1.0, 0.0)


@pytest.mark.parametrize("run, why", [
    ("apt-get update && apt-get install -y jq && make", "package manager or the network (`apt-get`)"),
    ("pip install numpy==2.0", "(`pip`)"), ("python3 -m pip install -r req.txt", "`python3 -m pip`"),
    ("curl -LsSf https://astral.sh/uv/install.sh | sh", "(`curl`)"), ("git clone https://x/y", "`git clone`"),
    ("useradd -m agent", "users or configuration (`useradd`)"), ("chown -R 1000:1000 /app", "ownership to 1000"),
    ("echo x > /etc/motd", "writes into /etc/motd"), ("cp tool /usr/local/bin/", "/usr/local/bin/"),
    ("no-such-tool-here --init", "`no-such-tool-here`, which this host lacks"),
])
def test_run_steps_that_need_a_container_say_why(run, why):
    plan = plan_dockerfile(f"FROM python:3.12-slim\nWORKDIR /app\nRUN {run}\n")
    assert not plan.steps and len(plan.reasons) == 1 and why in plan.reasons[0], plan.reasons


def test_a_run_that_only_installs_apt_packages_the_host_has_is_satisfied_by_the_hosts():
    have = plan_dockerfile("FROM ubuntu:24.04\nRUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                           "--no-install-recommends bash coreutils \\\n    && rm -rf /var/lib/apt/lists/*\n")
    assert not have.reasons and not have.steps and have.host_packages == ["bash", "coreutils"]
    lacks = plan_dockerfile("FROM ubuntu:24.04\nRUN apt-get install -y bash no-such-package-here\n")
    assert "installs apt packages this host lacks (no-such-package-here)" in lacks.reasons[0]


def test_python_base_images_have_python(tmp_path):
    """python:* images have `python`; where this host has only python3 the local sandbox provides it."""
    make_task(tmp_path, "py", files={"environment/Dockerfile": f"FROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\n",
                                     "solution/solve.sh": "#!/bin/bash\npython -c 'print(6*7)' > out.txt\n"},
              test_sh=check('[ "$(cat out.txt)" = 42 ]', 'python -c "import sys; sys.exit(0)"'))
    assert asyncio.run(oracle_and_noop(tmp_path, "py"))[:2] == (1.0, 0.0)


def test_host_tool_runs_are_local():
    for run in ("mkdir -p /data && cp a b", "sed -i 's/x/y/' conf.ini", "echo ok > out.txt; chmod +x run.sh",
                "if [ -f x ]; then rm x; fi", "python3 -c 'print(1)' > one.txt", "chown root:root file"):
        assert run_reason(run) is None, run


def test_a_run_step_that_fails_locally_routes_the_task_with_its_reason(tmp_path):
    make_task(tmp_path, "fails", files={
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\nRUN test -f /opt/prebuilt/marker\n",
        "solution/solve.sh": "#!/bin/bash\ntrue\n"})
    with pytest.raises(LocalSetupError, match=r"`RUN test -f /opt/prebuilt/marker` failed in the local sandbox.*"
                                              r"container sandbox"):
        asyncio.run(oracle_and_noop(tmp_path, "fails"))


def test_a_compose_file_with_one_service_is_read_as_that_service(tmp_path):
    compose = ("services:\n  main:\n    build:\n      context: ${CONTEXT_DIR}\n      dockerfile: Dockerfile\n"
               "    command: [\"sh\", \"-c\", \"sleep infinity\"]\n    environment:\n      - MODE=compose\n"
               "      - TEST_DIR=${TEST_DIR}\n    working_dir: /work\n    network_mode: none\n"
               "    volumes:\n      - ${HOST_VERIFIER_LOGS_PATH}:${ENV_VERIFIER_LOGS_PATH}\n")
    make_task(tmp_path, "compose", files={
        "environment/docker-compose.yaml": compose,
        "environment/Dockerfile": f"FROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\nCOPY x.txt ./\n",
        "environment/x.txt": "x\n",
        "solution/solve.sh": "#!/bin/bash\necho \"$MODE $TEST_DIR\" > /work/mode.txt\n"},
        test_sh=check('[ "$PWD" = /work ]', '[ "$(cat mode.txt)" = "compose /tests" ]', '[ -f /app/x.txt ]'))
    t = load_task(tmp_path / "compose")
    assert not t.needs_container and t.workdir == "/work" and t.env["MODE"] == "compose" and not t.network
    assert t.compose is not None and t.compose.name == "main" and t.files.keys() - {PYTHON_SHIM} == {"/app/x.txt"}
    assert asyncio.run(oracle_and_noop(tmp_path, "compose"))[:2] == (1.0, 0.0)
    two = make_task(tmp_path, "two", files={
        "environment/docker-compose.yaml": "services:\n  main:\n    build: .\n  redis:\n    image: redis:7\n"})
    assert "starts 2 services (main, redis)" in load_task(two).container_reasons[0]


@pytest.mark.parametrize("toml, want", [
    ('[environment]\nnetwork_mode = "public"\n', True), ('[environment]\nallow_internet = true\n', True),
    ('[verifier]\nnetwork_mode = "public"\n', True), ('[environment]\nnetwork_mode = "no-network"\n', False),
    ('version = "1.0"\n', False),
])
def test_the_tasks_network_request_is_read(tmp_path, toml, want):
    t = load_task(make_task(tmp_path, toml=toml))
    assert t.network is want
    assert TerminalBenchEnv(tmp_path).sandbox_spec(TerminalBenchEnv(tmp_path).tasks("all")[0]).network is want


def test_multi_key_reward_json_is_the_reward_and_its_parts(tmp_path):
    make_task(tmp_path, "multi", test_sh=("#!/bin/bash\necho '{\"reward\": 0.5, \"style\": 1.0, \"speed\": 0.25}' "
                                          "> /logs/verifier/reward.json\n"),
              files={"solution/solve.sh": "#!/bin/bash\ntrue\n"})
    env = TerminalBenchEnv(tmp_path)

    async def main():
        sandbox = local.LocalSandbox()
        task = env.tasks("all")[0]
        await sandbox.start(env.sandbox_spec(task))
        try:
            return await (await env.open(task, sandbox)).score([])
        finally:
            await sandbox.stop()
    reward = asyncio.run(main())
    assert reward.value == 0.5 and reward.parts["style"] == 1.0 and reward.parts["speed"] == 0.25


def test_eval_writes_per_task_results_with_every_reason(tmp_path):
    tasks = tmp_path / "tasks"
    make_task(tasks, "passes", files={"solution/solve.sh": "#!/bin/bash\ntrue\n"})
    make_task(tasks, "wrong", test_sh="#!/bin/bash\necho 'AssertionError: 2 != 3'\necho 0 > /logs/verifier/reward.txt\n"
                                      "exit 1\n", files={"solution/solve.sh": "#!/bin/bash\nexit 4\n"})
    make_task(tasks, "no-reward", test_sh="#!/bin/bash\necho nothing\n",
              files={"solution/solve.sh": "#!/bin/bash\ntrue\n"})
    make_task(tasks, "broken-run", files={"environment/Dockerfile": "FROM ubuntu\nRUN test -d /nope\n",
                                          "solution/solve.sh": "#!/bin/bash\ntrue\n"})
    make_task(tasks, "needs-image", toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n',
              files={"solution/solve.sh": "#!/bin/bash\ntrue\n"})
    job = tmp_path / "job"
    out = subprocess.run([sys.executable, "-m", "miles_agent.cli", "eval", "--env", "terminal-bench", "--policy",
                          "oracle", "--tasks", str(tasks), "--split", "all", "--job-dir", str(job)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["task"]: r for r in map(json.loads, (job / "results.jsonl").read_text().splitlines())}
    assert rows["passes"]["reward"] == 1.0 and rows["passes"]["reason"] is None
    assert rows["passes"]["route"]["backend"] == "local" and rows["passes"]["verifier_exit_code"] == 0
    wrong = rows["wrong"]
    assert wrong["reward"] == 0.0 and wrong["solve_exit_code"] == 4 and wrong["verifier_exit_code"] == 1
    assert "solve.sh exited 4" in wrong["reason"] and "AssertionError: 2 != 3" in wrong["verifier_tail"]
    assert "reward_file_missing" in rows["no-reward"]["reason"]
    assert rows["broken-run"]["failed"] and "RUN test -d /nope" in rows["broken-run"]["reason"]
    assert rows["needs-image"]["refused"] and "ghcr.io/x/y:1" in rows["needs-image"]["reason"]
    assert (job / "wrong" / "verifier" / "test-stdout.txt").read_text().startswith("AssertionError")
    summary = json.loads((job / "summary.json").read_text())
    assert summary["failed"] == 1 and summary["refused"] == 1 and summary["episodes"] == 4
    assert set(summary["below_1"]) == {"wrong", "no-reward", "broken-run", "needs-image"}
    assert "wrong" in out.stdout and "(1 failed, 1 refused)" in out.stdout


def test_auto_runs_local_tasks_locally_and_refuses_container_ones_without_an_engine(tmp_path):
    """env.sandbox=auto: a task this host reproduces (RUN steps included) runs on the local sandbox; one
    that needs its image is refused, with why, when no engine answers."""
    tasks = tmp_path / "tasks"
    make_task(tasks, "runs-here", files={"environment/Dockerfile": "FROM ubuntu\nWORKDIR /app\nRUN echo ok > made\n",
                                         "solution/solve.sh": "#!/bin/bash\ntrue\n"},
              test_sh=check('[ "$(cat /app/made)" = ok ]'))
    make_task(tasks, "needs-apt", files={"environment/Dockerfile": "FROM ubuntu\nRUN pip install numpy\n",
                                         "solution/solve.sh": "#!/bin/bash\ntrue\n"})
    job = tmp_path / "job"
    out = subprocess.run([sys.executable, "-m", "miles_agent.cli", "eval", "--env", "terminal-bench", "--policy",
                          "oracle", "--tasks", str(tasks), "--split", "all", "--job-dir", str(job), "env.sandbox=auto"],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**__import__("os").environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert out.returncode == 0, out.stderr
    rows = {r["task"]: r for r in map(json.loads, (job / "results.jsonl").read_text().splitlines())}
    assert rows["runs-here"]["reward"] == 1.0 and rows["runs-here"]["setup_steps"] == 1
    assert rows["runs-here"]["route"] == {"backend": "local", "reason": "the task needs only this host's tools"}
    refused = rows["needs-apt"]
    assert refused["refused"] and "`pip`" in refused["reason"] and "no-engine.sock does not answer" in refused["reason"]
    assert "task needs-apt needs its container" in out.stderr  # logged, as the route of every task (INFO)


def test_the_auto_sandbox_refuses_an_image_it_cannot_run(tmp_path, monkeypatch):
    from miles_agent.errors import UserError
    from miles_agent.sandbox import SandboxSpec
    from miles_agent.sandboxes.auto import AutoSandbox

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")

    async def main():
        sb = AutoSandbox()
        try:
            await sb.start(SandboxSpec(image="python:3.12-slim"))
        finally:
            await sb.stop()
    with pytest.raises(UserError, match=r"needs its container \(python:3.12-slim\), but the container engine at"):
        asyncio.run(main())


def test_under_auto_a_run_step_that_fails_locally_sends_the_task_to_a_container(tmp_path, monkeypatch):
    """The failure is the sandbox's (the episode is retried), and the task needs its container from then on."""
    from miles_agent.sandbox import SandboxError

    make_task(tmp_path, "fails", files={"environment/Dockerfile": "FROM ubuntu\nRUN test -f /opt/prebuilt\n"})
    env = TerminalBenchEnv(tmp_path, sandbox="auto")
    monkeypatch.setattr(env, "container_engine", lambda: (True, "a test engine"))
    task = env.tasks("all")[0]

    async def main():
        sandbox = local.LocalSandbox()
        await sandbox.start(env.sandbox_spec(task))
        try:
            await env.open(task, sandbox)
        finally:
            await sandbox.stop()
    with pytest.raises(SandboxError, match="goes to a container.*RUN test -f /opt/prebuilt"):
        asyncio.run(main())
    spec = env.sandbox_spec(task)
    assert env.harbor_task(task).needs_container and (spec.image or spec.build) is not None
    assert env.routes()["fails"][0] == "docker"


def test_a_python_image_of_another_version_needs_its_container():
    """Python 3.12 made float sum() exact: a public task on python-3-13 whose oracle passes there failed on
    this host's 3.11 (2.5499999999999994 != 2.55). The local sandbox stands in only for its own version."""
    from miles_agent.envs.terminal_bench.harbor import python_base_version, python_version_reason

    assert python_base_version("ghcr.io/laude-institute/t-bench/python-3-13:20250620") == "3.13"
    assert python_base_version("docker.io/library/python:3.12-slim-bookworm") == "3.12"
    assert python_base_version("python:3-slim") is None and python_base_version("ubuntu:24.04") is None
    other = OTHER_PYTHON
    assert python_version_reason(HOST_PYTHON_IMAGE) is None
    reason = python_version_reason(f"python:{other}-slim")
    assert reason == f"its base image python:{other}-slim is Python {other}; the local sandbox's python3 is {host_python_version()}"


def test_the_version_reason_keeps_such_a_task_off_the_local_sandbox(tmp_path):
    other = OTHER_PYTHON
    make_task(tmp_path, "newer", files={"environment/Dockerfile": f"FROM python:{other}-slim\nWORKDIR /app\n"})
    make_task(tmp_path, "same", files={"environment/Dockerfile": f"FROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\n"})
    newer, same = load_task(tmp_path / "newer"), load_task(tmp_path / "same")
    assert newer.needs_container and f"Python {other}" in newer.container_reasons[0]
    assert not same.needs_container
