"""Harbor tasks on a real container engine through the docker backend, as Harbor runs them: an image built
from environment/ (RUN steps, ENV PATH expansion, WORKDIR as the cwd, files owned by uid 1000) or a named
``docker_image``, the task's network request, tests uploaded only at verify time with the offline verifier
toolchain, and rewards read as Harbor reads them.

The tasks are written here in the shape of Terminal-Bench's. Needs ``MILES_AGENT_DOCKER_TEST_URL`` and
``MILES_AGENT_DOCKER_TEST_IMAGE`` (`.ci/container-engine.sh` sets both up: podman on a unix socket, Debian
base images made offline); the uv tests also need the prepared toolchain (``python -m
miles_agent.envs.terminal_bench.verifier_toolchain prepare``; `.ci/run` prepares it).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tarfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("docker")
from harbor_helpers import HOST_PYTHON_IMAGE  # noqa: E402

from miles_agent.envs.terminal_bench import TerminalBenchEnv  # noqa: E402
from miles_agent.envs.terminal_bench import verifier_toolchain as vt  # noqa: E402
from miles_agent.sandbox import SandboxError  # noqa: E402
from miles_agent.sandboxes.docker import DockerSandbox, connect  # noqa: E402

URL, IMAGE = os.environ.get("MILES_AGENT_DOCKER_TEST_URL"), os.environ.get("MILES_AGENT_DOCKER_TEST_IMAGE")
pytestmark = pytest.mark.skipif(not (URL and IMAGE), reason="no container engine configured: set "
                                "MILES_AGENT_DOCKER_TEST_URL and _IMAGE (source .ci/container-engine.sh)")
TOOLCHAIN = vt.resolve("auto")
needs_toolchain = pytest.mark.skipif(TOOLCHAIN is None, reason="the verifier toolchain is not prepared: python "
                                     "-m miles_agent.envs.terminal_bench.verifier_toolchain prepare")


def write_task(root: Path, name: str, *, test_sh: str, solve_sh: str = "true\n", dockerfile: str | None = None,
               environment: str = "", files: dict[str, bytes] | None = None,
               tests: dict[str, str] | None = None) -> Path:
    d = root / name
    for rel, data in {"instruction.md": b"Do the task.\n",
                      "task.toml": f'version = "1.0"\n[verifier]\ntimeout_sec = 120.0\n[agent]\ntimeout_sec = 120.0\n'
                                   f"[environment]\n{environment}".encode(),
                      "tests/test.sh": textwrap.dedent(test_sh).encode(),
                      "solution/solve.sh": textwrap.dedent(solve_sh).encode(),
                      **({"environment/Dockerfile": textwrap.dedent(dockerfile).encode()} if dockerfile else {}),
                      **{f"environment/{k}": v for k, v in (files or {}).items()},
                      **{f"tests/{k}": textwrap.dedent(v).encode() for k, v in (tests or {}).items()}}.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


async def oracle(env: TerminalBenchEnv, name: str, **options) -> tuple:
    """The oracle's solve.sh, then the verifier, in one container: (reward, session, solve result)."""
    task = next(t for t in env.tasks("all") if t.id == name)
    async with DockerSandbox(base_url=URL, image=IMAGE, **options) as sb:
        await sb.start(env.sandbox_spec(task))
        session = await env.open(task, sb)
        solved = await env.oracle_solve(task, sb)
        return await session.score([]), session, solved


def play(env: TerminalBenchEnv, name: str, **options) -> tuple:
    return asyncio.run(oracle(env, name, **options))


def uid_1000_tar() -> bytes:
    """A tarball as projects ship them: files owned by uid/gid 1000, not by root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("data/", b""), ("data/owned.txt", b"payload\n")):
            info = tarfile.TarInfo(name.rstrip("/"))
            info.uid = info.gid = 1000
            info.uname = info.gname = "builder"
            if name.endswith("/"):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


BUILT_DOCKERFILE = f"""\
    FROM {IMAGE}
    RUN mkdir -p /opt/tool/bin && printf '#!/bin/sh\\necho "greetings from tool"\\n' > /opt/tool/bin/greet \\
        && chmod +x /opt/tool/bin/greet
    ENV PATH="/opt/tool/bin:${{PATH}}"
    ENV APP_MODE=built
    WORKDIR /app
    COPY data.tar /app/data.tar
    """


def test_a_built_task_runs_in_its_image_with_workdir_env_path_and_uid_1000_files(tmp_path):
    # solve.sh works in the WORKDIR (relative paths), uses the tool on the expanded PATH and rm (still on
    # PATH), extracts files owned by uid 1000 and configures its HOME; test.sh checks each from its side.
    write_task(tmp_path, "built", dockerfile=BUILT_DOCKERFILE, files={"data.tar": uid_1000_tar()},
               solve_sh="""\
                   tar xf data.tar && rm data.tar
                   greet > out.txt && pwd >> out.txt && echo "$APP_MODE" >> out.txt
                   mkdir -p ~/.config/app && echo configured > ~/.config/app/state
                   """,
               test_sh="""\
                   #!/bin/bash
                   APP_DIR="${APP_DIR:-/app}"
                   ok=1
                   [ "$(cat "$APP_DIR/out.txt")" = "$(printf 'greetings from tool\\n/app\\nbuilt')" ] || ok=0
                   [ "$(stat -c %u "$APP_DIR/data/owned.txt")" = 1000 ] || ok=0
                   [ ! -e "$APP_DIR/data.tar" ] || ok=0
                   [ "$(pwd)" = /app ] || ok=0
                   [ "$(cat ~/.config/app/state)" = configured ] || ok=0  # the agent's HOME, as in Harbor
                   mkdir -p /logs/verifier && echo $ok > /logs/verifier/reward.txt
                   """)
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain="none")
    # The docker backend builds environment/ with its Dockerfile, even though this RUN could run locally.
    task = next(t for t in env.tasks("all") if t.id == "built")
    assert env.sandbox_spec(task).build is not None and env.sandbox_spec(task).image is None
    reward, session, solved = play(env, "built")
    assert solved.exit_code == 0, solved.stdout + solved.stderr
    assert reward.value == 1.0, session.reward_reason


def test_a_docker_image_task_runs_that_image_and_its_workdir(tmp_path):
    api = connect(URL)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {IMAGE}\nWORKDIR /srv/project\nRUN echo seeded > seed.txt\n")
    tag = "localhost/miles-agent-test/prebuilt:1"
    for _ in api.build(path=str(ctx), tag=tag, rm=True, decode=True):
        pass
    write_task(tmp_path, "prebuilt", environment=f'docker_image = "{tag}"\n',
               solve_sh="cat seed.txt > copy.txt\n",
               test_sh="""\
                   #!/bin/bash
                   mkdir -p /logs/verifier
                   [ "$(pwd)" = /srv/project ] && [ "$(cat copy.txt)" = seeded ] && echo 1 > /logs/verifier/reward.txt \\
                     || echo 0 > /logs/verifier/reward.txt
                   """)
    env = TerminalBenchEnv(tmp_path / "prebuilt", sandbox="docker", verifier_toolchain="none")
    spec = env.sandbox_spec(env.tasks("all")[0])
    assert spec.image == tag and spec.build is None
    reward, session, _ = play(env, "prebuilt")
    assert reward.value == 1.0, session.reward_reason


TB1_STYLE_TEST_SH = """\
    #!/bin/bash
    # As Terminal-Bench's run-tests.sh: fetch uv, then a venv with pinned pytest (the network is not there).
    curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
    source $HOME/.local/bin/env
    cd /tmp && uv venv .tbench-testing && source .tbench-testing/bin/activate
    uv pip install pytest==8.4.1
    uv run pytest /tests/test_outputs.py -rA
    if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
    """
TB2_STYLE_TEST_SH = """\
    #!/bin/bash
    uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json \\
      /tests/test_outputs.py -rA
    if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
    """
TEST_OUTPUTS = """\
    from pathlib import Path

    def test_answer():
        assert Path("/app/answer.txt").read_text().strip() == "42"
    """


@needs_toolchain
@pytest.mark.parametrize("style", [TB1_STYLE_TEST_SH, TB2_STYLE_TEST_SH], ids=["uv-pip", "uvx"])
def test_a_verifier_installs_pytest_with_uv_from_the_offline_toolchain(tmp_path, style):
    write_task(tmp_path, "pytest-task", dockerfile=f"FROM {IMAGE}\nWORKDIR /app\n", test_sh=style,
               solve_sh="echo 42 > answer.txt\n", tests={"test_outputs.py": TEST_OUTPUTS})
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain=str(TOOLCHAIN.root))
    reward, session, _ = play(env, "pytest-task")
    assert reward.value == 1.0, session.reward_reason
    # The detector: without the toolchain the same verifier cannot get pytest, and the reason says so.
    bare = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain="none")
    reward, session, _ = play(bare, "pytest-task")
    assert reward.value == 0.0 and "uv" in session.reward_reason and "test.sh exited" in session.reward_reason


def test_the_agent_never_sees_the_tests_or_the_toolchain(tmp_path):
    write_task(tmp_path, "peek", dockerfile=f"FROM {IMAGE}\nWORKDIR /app\n",
               solve_sh=f"ls /tests {vt.MOUNT} > seen.txt 2>&1; true\n",
               test_sh="""\
                   #!/bin/bash
                   mkdir -p /logs/verifier
                   grep -q "No such file" /app/seen.txt && [ -f /tests/test.sh ] && echo 1 > /logs/verifier/reward.txt
                   """)
    toolchain = str(TOOLCHAIN.root) if TOOLCHAIN else "none"
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain=toolchain)
    reward, session, _ = play(env, "peek")
    assert reward.value == 1.0, session.reward_reason


NET_TEST_SH = """\
    #!/bin/bash
    mkdir -p /logs/verifier
    nics=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | grep -v '^lo$' | wc -l)
    [ "$nics" -gt 0 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
    """


def test_a_task_that_asks_for_the_network_gets_it_unless_the_operator_forbids_it(tmp_path, caplog):
    write_task(tmp_path, "online", dockerfile=f"FROM {IMAGE}\n", environment='network_mode = "public"\n',
               test_sh=NET_TEST_SH)
    write_task(tmp_path, "offline", dockerfile=f"FROM {IMAGE}\n", test_sh=NET_TEST_SH)
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain="none")
    assert play(env, "online")[0].value == 1.0  # policy "task": on, as asked
    assert play(env, "offline")[0].value == 0.0  # not asked: no network
    with caplog.at_level(logging.WARNING, logger="miles_agent.sandboxes.docker"):
        assert play(env, "online", network="off")[0].value == 0.0
    assert any("asks for the network" in r.getMessage() and 'network="off"' in r.getMessage()
               for r in caplog.records)
    assert play(env, "offline", network="on")[0].value == 1.0


def test_a_multi_key_reward_json_is_the_multi_dimensional_reward_and_wins_over_reward_txt(tmp_path):
    write_task(tmp_path, "dims", dockerfile=f"FROM {IMAGE}\n", test_sh="""\
        #!/bin/bash
        mkdir -p /logs/verifier
        echo 1 > /logs/verifier/reward.txt
        echo '{"correctness": 1.0, "style": 0.5}' > /logs/verifier/reward.json
        """)
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain="none")
    reward, session, _ = play(env, "dims")
    assert reward.value == 0.75
    assert (reward.parts["correctness"], reward.parts["style"], reward.parts["reward_dimensions"]) == (1.0, 0.5, 2.0)
    assert "reward.json says" in session.reward_reason and "test.sh exited 0" in session.reward_reason


def test_a_failing_build_names_the_step_and_shows_the_log(tmp_path):
    write_task(tmp_path, "broken", test_sh="true\n", dockerfile=f"""\
        FROM {IMAGE}
        RUN echo preparing-the-step
        RUN echo about-to-fail && exit 3
        """)
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain="none")
    with pytest.raises(SandboxError) as info:
        play(env, "broken")
    message = str(info.value)
    assert "RUN echo about-to-fail && exit 3" in message and "about-to-fail" in message.split("build log")[1]
    with pytest.raises(SandboxError, match="exit 3"):  # remembered: the retry fails at once, same message
        play(env, "broken")


def test_a_missing_image_offline_says_how_to_provide_it(tmp_path):
    write_task(tmp_path, "absent", environment='docker_image = "localhost/miles-agent-test/absent:0"\n',
               test_sh="true\n")
    env = TerminalBenchEnv(tmp_path, sandbox="docker", verifier_toolchain="none")
    with pytest.raises(SandboxError, match=r"absent:0 is not on the engine.*(docker|podman) load"):
        play(env, "absent")


def test_a_python_base_task_that_also_runs_locally_opens_in_its_built_image(tmp_path):
    """A python:* task with only a WORKDIR and a COPY runs locally too, so its staged files include the
    local sandbox's `python` shim; through docker the image is built instead and open() must not touch them."""
    write_task(tmp_path, "py-base", dockerfile=f"FROM {HOST_PYTHON_IMAGE}\nWORKDIR /app\nCOPY run.sh /app/run.sh\n",
               files={"run.sh": b"#!/bin/sh\necho ran > /app/out.txt\n"}, solve_sh="sh /app/run.sh\n",
               test_sh="""\
                   #!/bin/bash
                   mkdir -p /logs/verifier
                   if grep -q ran /app/out.txt && python --version >/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
               """)
    (tmp_path / "py-base" / "environment" / "run.sh").chmod(0o755)
    env = TerminalBenchEnv(str(tmp_path), sandbox="docker")
    assert not env.harbor_task(next(t for t in env.tasks("all") if t.id == "py-base")).needs_container
    reward, _, solved = play(env, "py-base")
    assert solved.exit_code == 0 and reward.value == 1.0


SERVICE_TEST_SH = """\
    #!/bin/bash
    mkdir -p /logs/verifier
    if [ "$(cat /tmp/service.out 2>/dev/null)" = up ] && kill -0 "$(cat /tmp/service.pid)" 2>/dev/null \\
       && [ "$(awk '{print $3}' /proc/$(cat /tmp/service.pid)/stat)" != Z ]; then echo 1; else echo 0; fi \\
       > /logs/verifier/reward.txt
"""
SERVICE_START = "setsid sh -c 'echo $$ > /tmp/service.pid; echo up > /tmp/service.out; exec sleep 600' < /dev/null > /dev/null 2>&1 & sleep 0.3\n"


def test_a_service_the_oracle_starts_stays_up_for_the_tests_but_a_policys_is_ended(tmp_path):
    """Harbor keeps what solve.sh started (tests check a server it launched); the same command from a policy
    is ended before the verifier (it could rewrite the reward file), unless keep_agent_processes is set."""
    write_task(tmp_path, "service", dockerfile=f"FROM {IMAGE}\n", solve_sh=SERVICE_START, test_sh=SERVICE_TEST_SH)
    env = TerminalBenchEnv(str(tmp_path), sandbox="docker")
    reward, _, solved = play(env, "service")
    assert solved.exit_code == 0 and reward.value == 1.0

    async def as_policy(**options) -> float:
        task = next(t for t in env.tasks("all") if t.id == "service")
        async with DockerSandbox(base_url=URL, image=IMAGE, **options) as sb:
            await sb.start(env.sandbox_spec(task))
            session = await env.open(task, sb)
            await session.call_tool("bash", {"command": SERVICE_START})
            return (await session.score([])).value

    assert asyncio.run(as_policy()) == 0.0
    assert asyncio.run(as_policy(keep_agent_processes=True)) == 1.0


def test_a_task_image_is_rebuilt_when_its_base_image_changes(tmp_path):
    """The build cache is keyed by the context and by the ids of the bases: a base image replaced under the
    same name (a newer pull, a re-made stand-in) must not leave the task on the image built from the old one."""
    api = connect(URL)
    base = "localhost/miles-agent-test/base:moving"
    ctx = tmp_path / "base"
    ctx.mkdir()

    def make_base(mark: str) -> None:
        (ctx / "Dockerfile").write_text(f"FROM {IMAGE}\nRUN echo {mark} > /base-mark\n")
        for _ in api.build(path=str(ctx), tag=base, rm=True, decode=True):
            pass

    write_task(tmp_path / "tasks", "on-base", dockerfile=f"FROM {base}\nWORKDIR /app\n",
               solve_sh="cp /base-mark /app/seen\n",
               test_sh="""\
                   #!/bin/bash
                   mkdir -p /logs/verifier
                   [ "$(cat /app/seen)" = new ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
                   """)
    env = TerminalBenchEnv(tmp_path / "tasks", sandbox="docker", verifier_toolchain="none")
    try:
        make_base("old")
        assert play(env, "on-base")[0].value == 0.0
        make_base("new")
        assert play(env, "on-base")[0].value == 1.0
    finally:
        api.remove_image(base, force=True)
