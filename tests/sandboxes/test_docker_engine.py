"""The docker sandbox's isolation inside a real engine (Docker, or podman's Docker-compatible API).

Skipped unless ``MILES_AGENT_DOCKER_TEST_URL`` names an engine (e.g. ``unix:///run/podman.sock``) and
``MILES_AGENT_DOCKER_TEST_IMAGE`` an image it has with bash and coreutils. Each probe is first run in a
bare container made with the engine's defaults (to show it detects what it looks for), then in ours.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from sandbox_helpers import run

from miles_agent.sandbox import SandboxLimits, SandboxSpec

pytest.importorskip("docker")
from miles_agent.sandboxes.docker import TASK_CAPABILITIES, DockerSandbox, connect  # noqa: E402

URL, IMAGE = os.environ.get("MILES_AGENT_DOCKER_TEST_URL"), os.environ.get("MILES_AGENT_DOCKER_TEST_IMAGE")
pytestmark = pytest.mark.skipif(not (URL and IMAGE), reason="set MILES_AGENT_DOCKER_TEST_URL and _IMAGE")

CAP_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7,
            "NET_BIND_SERVICE": 10, "MKNOD": 27}
PROBE = ("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; echo nofile=$(ulimit -Hn); "
         "echo tmp=$(awk '$2 == \"/tmp\" {print $3}' /proc/mounts); "
         "echo 6 > /proc/sys/kernel/printk_ratelimit 2>/dev/null; echo sysctl_write=$?; "
         "mknod /tmp/sda b 8 0 2>/dev/null; echo mknod=$?; "
         "echo nics=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ,)")


def parse(stdout: str) -> dict[str, str]:
    return dict(line.replace(":\t", "=", 1).split("=", 1) for line in stdout.splitlines() if "=" in line or ":\t" in line)


def bare_container_probe() -> dict[str, str]:
    """The probe in a container with the engine's defaults (as `docker run IMAGE` would make it)."""
    api = connect(URL)
    cid = api.create_container(IMAGE, command=["bash", "-c", PROBE])["Id"]
    try:
        api.start(cid)
        api.wait(cid, timeout=60)
        return parse(api.logs(cid, stdout=True, stderr=False).decode())
    finally:
        api.remove_container(cid, force=True)


def sandbox_probe() -> dict[str, str]:
    async def episode() -> dict[str, str]:
        async with DockerSandbox(base_url=URL, image=IMAGE, tmp_bytes=64 << 20) as sb:
            await sb.start(SandboxSpec(limits=SandboxLimits(max_processes=64, max_open_files=512)))
            result = await sb.exec(PROBE, timeout_s=30)
            assert result.exit_code == 0, result.stderr
            return parse(result.stdout)

    return run(episode())


def test_the_probe_sees_the_engine_defaults():
    bare = bare_container_probe()
    caps = int(bare["CapEff"], 16)
    assert caps & (1 << CAP_BITS["MKNOD"]) and bare["NoNewPrivs"] == "0" and bare["mknod"] == "0"
    assert bare["tmp"] != "tmpfs" and bare["nics"] != "lo,"


def test_the_sandbox_container_is_isolated():
    ours = sandbox_probe()
    assert int(ours["CapEff"], 16) == sum(1 << CAP_BITS[c] for c in TASK_CAPABILITIES)
    assert ours["NoNewPrivs"] == "1" and ours["nofile"] == "512" and ours["tmp"] == "tmpfs"
    assert ours["sysctl_write"] != "0" and ours["mknod"] != "0"  # /proc/sys read-only, no device nodes
    assert ours["nics"] == "lo,"


def test_an_agents_background_process_cannot_forge_the_verdict(monkeypatch):
    """A setsid loop rewriting reward.txt: alive beside a verifier if nothing ends it, gone before ours.
    Whether the forger wins a race with the reward read is timing (it lost once on a loaded CI machine),
    so the detector asserts what decides it: the loop still runs after the verifier."""
    from miles_agent.envs.terminal_bench import TerminalBenchEnv

    forge = ("setsid bash -c 'echo $$ > /tmp/.forger; while :; do mkdir -p /logs/verifier; echo 1 > /logs/.r "
             "&& mv -f /logs/.r /logs/verifier/reward.txt; sleep 0.01; done' > /dev/null 2>&1 < /dev/null &"
             " sleep 0.2")  # atomic mv: never half-read; the pause lets the loop write its pid

    async def unsolved_with_forger() -> tuple[float, bool]:
        env = TerminalBenchEnv(sandbox="docker")
        task = next(t for t in env.tasks("all") if t.id == "hello-file")
        async with DockerSandbox(base_url=URL, image=IMAGE) as sb:
            await sb.start(env.sandbox_spec(task))
            session = await env.open(task, sb)
            await session.call_tool("bash", {"command": forge})
            reward = (await session.score([])).value
            # a killed loop may stay a zombie under an init that does not reap: read its state, not kill -0
            state = await sb.exec("awk '{print $3}' \"/proc/$(cat /tmp/.forger)/stat\"", timeout_s=10)
            return reward, state.stdout.strip() not in ("", "Z")

    with monkeypatch.context() as m:  # the detector: without ending the agent's processes the loop lives on
        m.setattr(DockerSandbox, "end_agent_processes", lambda self: asyncio.sleep(0))
        assert run(unsolved_with_forger())[1] is True
    assert run(unsolved_with_forger()) == (0.0, False)
