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

Each `exec` runs ``timeout -s KILL <t> bash -c CMD``
(the image needs bash and coreutils' timeout), so a timed-out command's process group is killed inside the
container and the result says ``timed_out``. Files go through the archive endpoints (tar).

Connection: ``base_url`` (default: $DOCKER_HOST or the local socket, as the docker CLI).
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_agent.errors import require
from miles_agent.sandbox import ExecResult, SandboxError, SandboxLimits, SandboxSpec

from ._remote import TIMEOUT_EXIT_CODE, WORKDIR, RemoteSandbox, RemoteSandboxOptions

LABEL = "miles-agent.sandbox"
EXPIRES_LABEL = "miles-agent.expires-at"
DEFAULT_IMAGE = "python:3.12-slim"
#: Added back after ``cap_drop ALL``: what a task (root in its own image: apt/pip installs, files owned by
#: other users, services it starts and stops) needs. Everything else in Docker's default set is dropped.
TASK_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL",
                     "NET_BIND_SERVICE")
DEFAULT_TMP_BYTES = 256 << 20


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
    network: bool = False
    cpus: float | None = None
    tmp_bytes: int = DEFAULT_TMP_BYTES
    api_timeout_s: float = 60.0


class DockerSandbox(RemoteSandbox):
    """One container per episode: no new privileges, few capabilities, memory/pids/nofile/CPU/tmp limits,
    no network, no host mounts, a TTL and a reaper label."""

    name = "docker"
    description = "a Docker container per episode (Docker Engine API): limits, no network, TTL auto-removal"
    auth_hint = "check DOCKER_HOST and that this user may use the Docker engine (the docker group)"
    options_type: ClassVar[type] = DockerSandboxOptions

    def __init__(self, *, base_url: str | None = None, image: str = DEFAULT_IMAGE, network: bool = False,
                 cpus: float | None = None, tmp_bytes: int = DEFAULT_TMP_BYTES, api_timeout_s: float = 60.0, **kwargs: Any) -> None:
        """``image``: used when the task names none. ``network``: allow the container network (default
        off). ``cpus``: CPU quota (NanoCpus). ``tmp_bytes``: size of the tmpfs on /tmp. Other keywords: see RemoteSandbox (ttl_s, retry)."""
        super().__init__(**kwargs)
        self.base_url = base_url
        self.default_image = image
        self.network = network
        self.cpus = cpus
        self.tmp_bytes = tmp_bytes
        self.api_timeout_s = api_timeout_s
        self.api: Any = None

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
        image = spec.image or self.default_image
        host_config = self.api.create_host_config(**self._host_config(spec.limits))
        expires = int(time.time() + self.ttl_s)

        def create() -> dict:
            return self.api.create_container(
                image, command=["sleep", str(int(self.ttl_s))], name=f"miles-agent-{uuid.uuid4().hex[:12]}",
                working_dir=WORKDIR, environment=dict(spec.env), host_config=host_config,
                labels={LABEL: "1", EXPIRES_LABEL: str(expires)}, network_disabled=not self.network)

        docker = _docker()
        try:
            created = self.call("create container", create)
        except SandboxError as e:
            if not isinstance(e.__cause__, docker.errors.ImageNotFound):
                raise
            self.call(f"pull {image}", self._pull, image)
            created = self.call("create container", create)
        self.handle = created["Id"]
        self.call("start container", self.api.start, self.handle)
        self.call("make workspace", self._mkdir, WORKDIR)

    async def end_agent_processes(self) -> None:
        """SIGKILL every process of the container but its main one (our ``sleep``) and this command's own
        chain. Guarded on PID 1 being our ``sleep``, so it can never run where PID 1 is not ours."""
        ttl = int(self.ttl_s)
        script = (f'[ "$(tr "\\0" " " < /proc/1/cmdline)" = "sleep {ttl} " ] || exit 0; '
                  'for d in /proc/[0-9]*; do p=${d#/proc/}; '
                  'case $p in 1|$$|$PPID) ;; *) kill -9 "$p" 2>/dev/null;; esac; done; true')
        await self.exec(script, timeout_s=30)

    def _host_config(self, limits: SandboxLimits) -> dict[str, Any]:
        """HostConfig keywords: the limits and the isolation described in the module docstring. Nothing
        here may name a host path (no binds, volumes, devices) or a host namespace."""
        return {
            "auto_remove": True,
            "security_opt": ["no-new-privileges:true"],
            "cap_drop": ["ALL"], "cap_add": list(TASK_CAPABILITIES),
            "mem_limit": limits.memory_bytes, "memswap_limit": limits.memory_bytes,
            "pids_limit": limits.max_processes,
            "ulimits": [_docker().types.Ulimit(name="nofile", soft=limits.max_open_files, hard=limits.max_open_files),
                        _docker().types.Ulimit(name="fsize", soft=limits.max_file_bytes, hard=limits.max_file_bytes)],
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,mode=1777,size={self.tmp_bytes}"},
            "nano_cpus": int(self.cpus * 1e9) if self.cpus else None,
            "network_mode": None if self.network else "none",
        }

    def _pull(self, image: str) -> None:
        repo, _, tag = image.partition(":") if "@" not in image else (image, "", "")
        for event in self.api.pull(repo, tag=tag or "latest", stream=True, decode=True):
            if "error" in event:
                raise _docker().errors.APIError(f"pull {image}: {event['error']}")

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
        out, err = self.api.exec_start(exec_id, demux=True)  # not retried: the command has run
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
