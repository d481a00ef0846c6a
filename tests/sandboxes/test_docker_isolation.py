"""The docker sandbox's isolation, read off the create request the engine receives (issue 13).

The engine enforces what HostConfig asks for, so the request is the contract: never privileged,
no-new-privileges, all capabilities dropped but the few a task needs, pids/nofile/memory limits with no
extra swap, a size-limited tmpfs on /tmp, no network, no host mounts or namespaces, and the engine's
read-only /proc/sys left in place. `isolation_problems` names each missing protection; it is first shown
to fire on a create request that lacks them, one at a time, so the test cannot pass vacuously.
"""

from __future__ import annotations

import copy

import pytest
from fake_docker import FakeDockerEngine
from sandbox_helpers import run

from miles_agent.sandbox import SandboxLimits, SandboxSpec

pytest.importorskip("docker")
from miles_agent.sandboxes.docker import TASK_CAPABILITIES, DockerSandbox  # noqa: E402

#: Capabilities a container may hold: never one that reaches past the container (SYS_ADMIN, SYS_MODULE,
#: SYS_PTRACE, NET_ADMIN, ...), nor MKNOD (device nodes) or NET_RAW (raw sockets).
ALLOWED_CAPS = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL", "NET_BIND_SERVICE"}
HOST_NAMESPACE_KEYS = ("NetworkMode", "PidMode", "IpcMode", "UTSMode", "UsernsMode", "CgroupnsMode")
UNCONFINED = ("systempaths=unconfined", "seccomp=unconfined", "apparmor=unconfined", "seccomp:unconfined",
              "apparmor:unconfined")


def isolation_problems(body: dict, network: bool = False) -> list[str]:
    """Every protection the create request ``body`` lacks, by name (empty when it has them all)."""
    host = body.get("HostConfig") or {}
    security = host.get("SecurityOpt") or []
    problems = []
    if host.get("Privileged"):
        problems.append("privileged")
    if not {"no-new-privileges", "no-new-privileges:true", "no-new-privileges=true"} & set(security):
        problems.append("no-new-privileges missing")
    if [o for o in security if o in UNCONFINED]:
        problems.append("a security profile turned off")
    if "ALL" not in (host.get("CapDrop") or []):
        problems.append("capabilities not dropped")
    if set(host.get("CapAdd") or []) - ALLOWED_CAPS:
        problems.append(f"extra capabilities {sorted(set(host['CapAdd']) - ALLOWED_CAPS)}")
    if not (host.get("PidsLimit") or 0) > 0:
        problems.append("no pids limit")
    nofile = [u for u in host.get("Ulimits") or [] if u.get("Name") == "nofile"]
    if not nofile or not 0 < nofile[0].get("Hard", 0) <= 65536:
        problems.append("no nofile ulimit")
    if not (host.get("Memory") or 0) > 0:
        problems.append("no memory limit")
    elif host.get("MemorySwap") != host["Memory"]:
        problems.append("swap beyond the memory limit")
    tmp = (host.get("Tmpfs") or {}).get("/tmp", "")
    if "size=" not in tmp:
        problems.append("no size-limited tmpfs on /tmp")
    if not network and (host.get("NetworkMode") != "none" or not body.get("NetworkDisabled")):
        problems.append("network not disabled")
    if any(host.get(k) for k in ("Binds", "Mounts", "VolumesFrom", "Devices", "DeviceRequests")) \
            or body.get("Volumes"):
        problems.append("host mounts or devices")
    if [k for k in HOST_NAMESPACE_KEYS if host.get(k) == "host"]:
        problems.append("a host namespace")
    if "ReadonlyPaths" in host or "MaskedPaths" in host:  # overriding them drops the engine's read-only /proc/sys
        problems.append("the engine's read-only /proc paths overridden")
    return problems


@pytest.fixture
def engine():
    with FakeDockerEngine() as e:
        yield e
        assert e.live() == [], "containers left behind"


def create_request(engine: FakeDockerEngine, **options) -> dict:
    """The body of the create request one started sandbox sent to the engine."""
    async def episode() -> dict:
        async with DockerSandbox(base_url=engine.base_url, **options) as sb:
            await sb.start(SandboxSpec(limits=SandboxLimits(memory_bytes=512 << 20, max_processes=64, max_open_files=512)))
            return copy.deepcopy(engine.containers[sb.handle].body)

    return run(episode())


def test_the_detector_fires_on_an_unhardened_request(engine):
    body = create_request(engine)
    assert isolation_problems(body) == []
    # What this backend sent before issue 13: limits and no network, but nothing else.
    before = {"Image": "python:3.12-slim", "NetworkDisabled": True,
              "HostConfig": {"AutoRemove": True, "Memory": 1 << 30, "PidsLimit": 256, "NetworkMode": "none"}}
    assert isolation_problems(before) == ["no-new-privileges missing", "capabilities not dropped",
                                          "no nofile ulimit", "swap beyond the memory limit",
                                          "no size-limited tmpfs on /tmp"]
    weakened = {
        "Privileged": True, "SecurityOpt": ["no-new-privileges:true", "seccomp=unconfined"],
        "CapAdd": [*TASK_CAPABILITIES, "SYS_ADMIN"], "PidsLimit": 0, "Ulimits": [], "MemorySwap": -1,
        "Tmpfs": {"/tmp": "rw"}, "NetworkMode": "host", "Binds": ["/home:/home"], "PidMode": "host",
        "MaskedPaths": [],
    }
    for key, value in weakened.items():  # each weakening alone is caught
        one = copy.deepcopy(body)
        one["HostConfig"][key] = value
        assert isolation_problems(one), f"{key}={value!r} went unnoticed"
    for key in ("SecurityOpt", "CapDrop", "PidsLimit", "Ulimits", "Memory", "Tmpfs", "NetworkMode"):
        one = copy.deepcopy(body)
        del one["HostConfig"][key]
        assert isolation_problems(one), f"a request without {key} went unnoticed"


def test_every_container_is_created_isolated(engine):
    body = create_request(engine, tmp_bytes=64 << 20)
    assert isolation_problems(body) == []
    host = body["HostConfig"]
    assert not host.get("Privileged") and host["CapDrop"] == ["ALL"]
    assert sorted(host["CapAdd"]) == sorted(TASK_CAPABILITIES)
    assert (host["Memory"], host["MemorySwap"], host["PidsLimit"]) == (512 << 20, 512 << 20, 64)
    assert host["Ulimits"] == [{"Name": "nofile", "Soft": 512, "Hard": 512},
                               {"Name": "fsize", "Soft": 256 << 20, "Hard": 256 << 20},
                               {"Name": "nproc", "Soft": 16384, "Hard": 16384}]
    assert host["Tmpfs"] == {"/tmp": f"rw,nosuid,nodev,mode=1777,size={64 << 20}"}


def test_network_is_the_only_thing_a_task_may_turn_on(engine):
    body = create_request(engine, network=True)
    assert isolation_problems(body, network=True) == []
    assert body["HostConfig"].get("NetworkMode") != "none"
    assert isolation_problems(body) == ["network not disabled"]
