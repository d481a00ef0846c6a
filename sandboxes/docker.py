"""The Docker sandbox: one container per episode, through the Docker Engine API (the ``docker`` SDK).

The container runs ``sleep <ttl>`` as its main process with ``AutoRemove``: if we never stop it (the trainer
was SIGKILLed) it exits and is removed by the engine when the TTL runs out. It also carries the labels
``miles-agent.sandbox=1`` and ``miles-agent.expires-at=<unix time>``, so `reap` (``miles-agent sandbox reap
--backend docker``) removes expired ones even on an engine that lost the auto-remove (a daemon restart).

Limits map to HostConfig: memory (``Memory``, with ``MemorySwap`` equal so swap adds nothing), processes
(``PidsLimit``), open files and file size per process (``nofile`` and ``fsize`` ulimits, from ``max_open_files``
and ``max_file_bytes``), CPU
(``NanoCpus``, from the ``cpus`` option), a size-limited tmpfs on ``/tmp`` (``tmp_bytes``, default 256 MiB;
nosuid, nodev; its pages count against the memory limit), no network unless ``network=True``.

Isolation (issue 13: the agent's commands are hostile). The container is never privileged and gets:
``no-new-privileges`` (a setuid binary in the image cannot raise privileges); ``cap_drop ALL`` and back only
`TASK_CAPABILITIES`, what a task running as root in its own image needs to install packages and own files
(chown, file permission overrides, setuid/setgid for apt's sandbox user, kill, binding ports below 1024 on
loopback) -- not MKNOD, NET_RAW, SYS_CHROOT, SETFCAP, SETPCAP or AUDIT_WRITE from Docker's default set;
no bind mounts, volumes, devices, or host namespaces (network, PID, IPC, UTS). ``/proc/sys``,
``/proc/sysrq-trigger`` and friends stay read-only or masked: that is the engine's default for a
non-privileged container, so we set neither ``privileged`` nor ``ReadonlyPaths``/``MaskedPaths``.
Not done here, and the daemon's job: user-namespace remapping (``dockerd --userns-remap``, rootless Docker,
or rootless podman) so that root in the container is not uid 0 on the host, a seccomp/AppArmor profile
(the engine's default applies), and a disk quota on the container's writable layer (``storage_opt size``
needs overlay2 on xfs with pquota). For untrusted code at scale, run the engine inside a VM.

Images (`_docker_build`). A spec's ``build`` (a task's environment/ and Dockerfile) is built once per content
hash and reused; ``image`` is used when the engine has it and pulled only when it does not (offline, a clear
error naming the fix: load or tag it). The container's default cwd, where relative files land, is the spec's
``workdir``, else the image's own WORKDIR, else /workspace.

Network, as a policy (option ``network``): "task" (the default) gives the container the engine's default
network exactly when the task asks for it (``spec.network``); "off" never does, and logs a warning naming
the task's request it overrides; "on" always does. CPUs: the task's ``spec.cpus``, else the ``cpus``
option, capped at the engine's CPU count.

Verifier. `run_verifier` kills what the agent left running first, then copies each ``VerifierRun.host_dirs``
folder into the container (fresh, after removing whatever the agent put at that path), and only then the
tests: nothing of the verifier is in the container while the agent acts.

Each `exec` runs ``timeout -s KILL <t> bash -c CMD``
(the image needs bash and coreutils' timeout), so a timed-out command's process group is killed inside the
container and the result says ``timed_out``. Files go through the archive endpoints (tar).

Connection: ``base_url`` (default: $DOCKER_HOST or the local socket, as the docker CLI). Podman works through
``podman system service`` (its Docker-compatible API); `.ci/container-engine.sh` sets one up.
Timeouts: ``api_timeout_s`` bounds each API call; a command's call waits its own timeout on top, and builds
and pulls ``build_timeout_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import posixpath
import shlex
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_agent.errors import UserError, require
from miles_agent.sandbox import (
    ExecResult,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    VerifierResult,
    VerifierRun,
)

from ._docker_build import ensure_built, ensure_image, image_workdir
from ._remote import TIMEOUT_EXIT_CODE, WORKDIR, RemoteSandbox, RemoteSandboxOptions

log = logging.getLogger(__name__)
NETWORK_POLICIES = ("task", "off", "on")

LABEL = "miles-agent.sandbox"
EXPIRES_LABEL = "miles-agent.expires-at"
DEFAULT_IMAGE = "python:3.12-slim"
#: Added back after ``cap_drop ALL``: what a task (root in its own image: apt/pip installs, files owned by
#: other users, services it starts and stops) needs. Everything else in Docker's default set is dropped.
TASK_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL",
                     "NET_BIND_SERVICE")
DEFAULT_TMP_BYTES = 256 << 20
DEFAULT_NPROC = 16384


def _docker():  # noqa: ANN202 - the module
    return require("docker", "docker", "the docker sandbox")


def connect(base_url: str | None = None, timeout_s: float = 60.0):  # noqa: ANN201 - docker.APIClient
    docker = _docker()
    try:
        if base_url:
            return docker.APIClient(base_url=base_url, version="auto", timeout=timeout_s)
        return docker.from_env(timeout=timeout_s).api
    except docker.errors.DockerException as e:
        raise SandboxError(f"docker sandbox: cannot reach the Docker engine ({e}); start Docker or set "
                           "DOCKER_HOST (or the sandbox's base_url) to a reachable engine") from e


@dataclass(frozen=True)
class DockerSandboxOptions(RemoteSandboxOptions):
    """``env.sandbox_options`` of the docker backend: DockerSandbox's keywords, typed."""

    base_url: str | None = None
    image: str = DEFAULT_IMAGE
    network: str | bool = "task"
    cpus: float | None = None
    tmp_bytes: int = DEFAULT_TMP_BYTES
    api_timeout_s: float = 60.0
    build_timeout_s: float = 3600.0
    nproc: int = DEFAULT_NPROC
    keep_agent_processes: bool = False


class DockerSandbox(RemoteSandbox):
    """One container per episode: no new privileges, few capabilities, memory/pids/nofile/CPU/tmp limits,
    no network, no host mounts, a TTL and a reaper label."""

    name = "docker"
    description = "a Docker container per episode (Docker Engine API): limits, no network, TTL auto-removal"
    auth_hint = "check DOCKER_HOST and that this user may use the Docker engine (the docker group)"
    options_type: ClassVar[type] = DockerSandboxOptions

    def __init__(self, *, base_url: str | None = None, image: str = DEFAULT_IMAGE, network: str | bool = "task",
                 cpus: float | None = None, tmp_bytes: int = DEFAULT_TMP_BYTES, api_timeout_s: float = 60.0,
                 build_timeout_s: float = 3600.0, nproc: int = DEFAULT_NPROC, keep_agent_processes: bool = False,
                 **kwargs: Any) -> None:
        """``image``: used when the task names none. ``network``: "task" (on when the task asks), "off",
        "on" (True/False read as "on"/"off"). ``cpus``: CPU quota when the task sets none. ``tmp_bytes``:
        size of the tmpfs on /tmp. ``keep_agent_processes``: leave what the agent started running for the
        verifier, as Harbor does (services a test checks stay up; a background loop can then forge the
        reward file). Other keywords: see RemoteSandbox (ttl_s, retry)."""
        super().__init__(**kwargs)
        policy = {True: "on", False: "off"}.get(network, network) if isinstance(network, bool) else network
        if policy not in NETWORK_POLICIES:
            raise UserError(f"docker sandbox: network={network!r} is not a policy; use one of "
                            f"{', '.join(NETWORK_POLICIES)} (\"task\": on when the task asks for it)")
        self.base_url = base_url
        self.default_image = image
        self.network = policy
        self.cpus = cpus
        self.tmp_bytes = tmp_bytes
        self.api_timeout_s = api_timeout_s
        self.build_timeout_s = build_timeout_s
        self.nproc = nproc
        self.keep_agent_processes = keep_agent_processes
        self.network_on = False  # decided per episode in _create
        self.image = ""  # what the container runs (a built tag or a named image)
        self.api: Any = None
        self._clients: dict[int, Any] = {}  # timeout -> a client for calls that wait (commands, builds)

    def _classify(self, exc: BaseException) -> tuple[str | None, float | None]:
        kind, after = super()._classify(exc)
        if kind:
            return kind, after
        docker = _docker()
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return "transient", None
        if isinstance(exc, docker.errors.APIError) and exc.response is not None:
            code = exc.response.status_code
            after = exc.response.headers.get("Retry-After")
            if code == 429:
                return "rate_limit", float(after) if after and after.isdigit() else None
            if code in (401, 403):
                return "auth", None
            if code in (500, 502, 503, 504) and "toomanyrequests" in str(exc).lower():
                return "rate_limit", None  # a registry pull rate limit, reported by the engine as a 500
            if code in (502, 503, 504):
                return "transient", None
        return None, None

    # -- hooks -----------------------------------------------------------------------------------

    def _create(self, spec: SandboxSpec) -> None:
        self.api = connect(self.base_url, self.api_timeout_s)
        if spec.build is not None:
            self.image = self.call("build image", ensure_built, self.api, spec.build, self._client,
                                   timeout_s=self.build_timeout_s)
        else:
            self.image = spec.image or self.default_image
        inspect = self.call(f"image {self.image}", ensure_image, self.api, self.image, self._client,
                            timeout_s=self.build_timeout_s)
        self.workdir = spec.workdir or image_workdir(inspect) or WORKDIR
        self.network_on = self._network_for(spec)
        host_config = self.api.create_host_config(**self._host_config(spec.limits, self._nano_cpus(spec)))
        expires = int(time.time() + self.ttl_s)
        created = self.call("create container", self.api.create_container,
                            self.image, command=["sleep", str(int(self.ttl_s))],
                            name=f"miles-agent-{uuid.uuid4().hex[:12]}", working_dir=self.workdir,
                            environment=dict(spec.env), host_config=host_config,
                            labels={LABEL: "1", EXPIRES_LABEL: str(expires)}, network_disabled=not self.network_on)
        self.handle = created["Id"]
        self.call("start container", self.api.start, self.handle)
        self.call("make workspace", self._mkdir, self.workdir)

    def _client(self, timeout_s: float) -> Any:
        """A client on the same engine whose calls may wait ``timeout_s`` (the API client's own timeout
        would cut a long, silent command or build short)."""
        key = max(1, int(timeout_s + 0.999))
        if key not in self._clients:
            docker = _docker()
            kwargs = {"base_url": self.base_url} if self.base_url else docker.utils.kwargs_from_env()
            self._clients[key] = docker.APIClient(version=self.api.api_version, timeout=key, **kwargs)
        return self._clients[key]

    def _network_for(self, spec: SandboxSpec) -> bool:
        if self.network == "on":
            return True
        if self.network == "off":
            if spec.network:
                log.warning("docker sandbox: the task asks for the network (network_mode/allow_internet) but the "
                            "sandbox option network=\"off\" denies it; commands that fetch will fail")
            return False
        return spec.network

    def _nano_cpus(self, spec: SandboxSpec) -> int | None:
        cpus = spec.cpus or self.cpus
        if not cpus:
            return None
        try:
            available = float(self.api.info().get("NCPU") or 0)
        except Exception:  # noqa: BLE001 - the cap is a courtesy; the engine still enforces its own range
            available = 0.0
        if available and cpus > available:
            log.info("docker sandbox: the task asks for %.2f CPUs, the engine has %.0f; capped", cpus, available)
            cpus = available
        return int(cpus * 1e9)

    async def end_agent_processes(self) -> None:
        """SIGKILL every process of the container but its main one (our ``sleep``) and this command's own
        chain. Guarded on PID 1 being our ``sleep``, so it can never run where PID 1 is not ours. Nothing
        with ``keep_agent_processes``."""
        if self.keep_agent_processes:
            return
        ttl = int(self.ttl_s)
        script = (f'[ "$(tr "\\0" " " < /proc/1/cmdline)" = "sleep {ttl} " ] || exit 0; '
                  'for d in /proc/[0-9]*; do p=${d#/proc/}; '
                  'case $p in 1|$$|$PPID) ;; *) kill -9 "$p" 2>/dev/null;; esac; done; true')
        await self.exec(script, timeout_s=30)

    async def run_verifier(self, run: VerifierRun) -> VerifierResult:
        """The base verifier run, after the agent's processes are gone and ``run.host_dirs`` are copied in
        (each target removed first: whatever the agent left at that path is replaced)."""
        if run.end_agent_processes:
            await self.end_agent_processes()
            run = dataclasses.replace(run, end_agent_processes=False)  # done: the base need not repeat it
        if run.host_dirs:
            self._check_running()
            for target, source in sorted(run.host_dirs.items()):
                await asyncio.to_thread(self.call, f"copy {source} to {target}", self._put_host_dir, source, target)
        verdict = await super().run_verifier(run)
        if verdict.result is not None:
            # The base lists the outputs with a short exec, whose output podman's exec attach can lose
            # when the command exits at once: an output it did not list is asked for by the archive
            # endpoint too (a regular file only, as the listing demands).
            for name in run.outputs:
                if name not in verdict.outputs:
                    try:
                        data = await asyncio.to_thread(self._read, posixpath.join(run.output_dir, name))
                    except SandboxError:
                        continue
                    verdict.outputs[name] = data[:run.max_output_file_bytes]
        return verdict

    def _put_host_dir(self, source: str, target: str) -> None:
        if not os.path.isdir(source):
            raise SandboxError(f"docker sandbox: verifier folder {source} does not exist on this host; prepare it "
                               "(e.g. python -m miles_agent.envs.terminal_bench.verifier_toolchain prepare)")
        if not posixpath.isabs(target) or posixpath.normpath(target) == "/":
            raise SandboxError(f"docker sandbox: verifier folder target {target!r} must be an absolute path below /")
        target = posixpath.normpath(target)
        cleared = self._exec(f"rm -rf {shlex.quote(target)} && mkdir -p {shlex.quote(posixpath.dirname(target))}",
                             120.0, "/", {})
        if cleared.exit_code != 0:
            raise SandboxError(f"docker sandbox: cannot clear {target} for the verifier: {cleared.stderr.strip()[-300:]}")
        with tempfile.TemporaryFile() as buf:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                # Owned by root, no write bits: the verifier reads it; symlinks kept as links (uv's layout).
                def readonly(info: tarfile.TarInfo) -> tarfile.TarInfo:
                    info.uid = info.gid = 0
                    info.uname = info.gname = "root"
                    info.mode &= ~0o222
                    return info

                tar.add(source, arcname=target.lstrip("/"), filter=readonly)
            buf.seek(0)
            self._client(self.build_timeout_s).put_archive(self.handle, "/", buf)

    def _host_config(self, limits: SandboxLimits, nano_cpus: int | None = None) -> dict[str, Any]:
        """HostConfig keywords: the limits and the isolation described in the module docstring. Nothing
        here may name a host path (no binds, volumes, devices) or a host namespace. The ulimits are
        explicit (an engine without CAP_SYS_RESOURCE cannot raise to its defaults); nproc is not a
        process budget: RLIMIT_NPROC counts a uid's processes host-wide (root is exempt), so ``PidsLimit`` bounds the
        container and ``nproc`` (option, default 16384) only has to fit under the engine's own limit."""
        return {
            "auto_remove": True,
            "security_opt": ["no-new-privileges:true"],
            "cap_drop": ["ALL"], "cap_add": list(TASK_CAPABILITIES),
            "mem_limit": limits.memory_bytes, "memswap_limit": limits.memory_bytes,
            "pids_limit": limits.max_processes,
            "ulimits": [_docker().types.Ulimit(name="nofile", soft=limits.max_open_files, hard=limits.max_open_files),
                        _docker().types.Ulimit(name="fsize", soft=limits.max_file_bytes, hard=limits.max_file_bytes),
                        _docker().types.Ulimit(name="nproc", soft=self.nproc, hard=self.nproc)],
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,mode=1777,size={self.tmp_bytes}"},
            "nano_cpus": nano_cpus,
            "network_mode": None if self.network_on else "none",
        }

    def _mkdir(self, path: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(path.strip("/"))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        self.api.put_archive(self.handle, "/", buf.getvalue())

    def _exec(self, command: str, timeout_s: float, cwd: str, env: dict[str, str]) -> ExecResult:
        argv = ["timeout", "-s", "KILL", f"{max(timeout_s, 0.001):.3f}", "bash", "-c", command]
        started = time.monotonic()
        exec_id = self.call("exec create", self.api.exec_create, self.handle, argv,
                            environment=env or None, workdir=cwd)["Id"]
        waiter = self._client(timeout_s + self.api_timeout_s)
        out, err = waiter.exec_start(exec_id, demux=True)  # not retried: the command has run
        code = self.call("exec inspect", self.api.exec_inspect, exec_id)["ExitCode"]
        duration = time.monotonic() - started
        timed_out = code == TIMEOUT_EXIT_CODE and duration >= timeout_s * 0.95
        return ExecResult(exit_code=code if code is not None else -1, stdout=(out or b"").decode(errors="replace"),
                          stderr=(err or b"").decode(errors="replace"), duration_s=duration, timed_out=timed_out,
                          limit_hit="wall_time" if timed_out else None)

    def _read(self, path: str) -> bytes:
        docker = _docker()
        try:
            stream, _stat = self.api.get_archive(self.handle, path)
        except docker.errors.NotFound as e:
            raise SandboxError(f"docker sandbox: {path} does not exist in the container") from e
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r") as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxError(f"docker sandbox: {path} is not a regular file")
            return tar.extractfile(member).read()

    def _write(self, path: str, content: bytes) -> None:
        parent, name = posixpath.split(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            # Parent folders as tar entries: put_archive needs its target folder to exist.
            parts = [p for p in parent.strip("/").split("/") if p]
            for i in range(len(parts)):
                info = tarfile.TarInfo("/".join(parts[: i + 1]))
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            info = tarfile.TarInfo(posixpath.join(*parts, name) if parts else name)
            info.size, info.mode, info.mtime = len(content), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(content))
        self.api.put_archive(self.handle, "/", buf.getvalue())

    @staticmethod
    def reap(base_url: str | None = None, now: float | None = None) -> list[str]:
        """Remove every container carrying our label whose expiry has passed; returns their ids."""
        api = connect(base_url)
        now = time.time() if now is None else now
        removed = []
        for c in api.containers(all=True, filters={"label": LABEL}):
            try:
                expires = float((c.get("Labels") or {}).get(EXPIRES_LABEL, "inf"))
            except ValueError:
                continue
            if expires <= now:
                try:
                    api.remove_container(c["Id"], force=True)
                except _docker().errors.NotFound:
                    continue
                removed.append(c["Id"])
        return removed

    def _destroy(self, handle: Any) -> None:
        api = self.api or connect(self.base_url, self.api_timeout_s)
        try:
            api.remove_container(handle, force=True)
        except _docker().errors.NotFound:
            pass  # gone already (auto-removed after its TTL, or a second stop)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
