"""The ``auto`` sandbox: each episode on the local sandbox when its task runs faithfully there, else on a
container engine when one is reachable, else refused with the reason.

The environment decides what "faithfully" means and says it in the spec: a spec with neither ``image``
nor ``build`` runs on this host (terminal-bench leaves both empty for a task whose Dockerfile the local
sandbox reproduces); any other goes to the docker backend, which builds or runs the image. The choice
and its reason are logged and kept in ``route`` (eval's per-task results record it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from miles_agent import registry
from miles_agent.build import sandbox_factory
from miles_agent.errors import UserError
from miles_agent.sandbox import ExecResult, Sandbox, SandboxError, SandboxSpec, VerifierResult, VerifierRun

log = logging.getLogger(__name__)
DEFAULT_SOCKET = "/var/run/docker.sock"
_engine_cache: dict[str, tuple[bool, str]] = {}


@dataclass(frozen=True)
class AutoSandboxOptions:
    """``env.sandbox_options`` of ``auto``: each backend's own options, and the network policy for both."""

    local: dict[str, Any] = field(default_factory=dict)
    docker: dict[str, Any] = field(default_factory=dict)
    network: str = "task"  # "task" | "off" | "on", as the local and docker backends take it


def container_engine(options: dict[str, Any] | None = None) -> tuple[bool, str]:
    """Whether a Docker-compatible engine answers, and where (or why not): the docker backend's
    ``base_url``, else $DOCKER_HOST, else the local socket. Asked once per address."""
    base_url = ((options or {}).get("docker") or {}).get("base_url") or os.environ.get("DOCKER_HOST")
    where = base_url or f"unix://{DEFAULT_SOCKET}"
    if where in _engine_cache:
        return _engine_cache[where]
    if not base_url and not os.path.exists(DEFAULT_SOCKET):
        found = (False, "no container engine is reachable (set DOCKER_HOST, or the docker backend's base_url)")
    else:
        try:
            import docker  # noqa: F401 - the SDK the docker backend needs
        except ImportError:
            found = (False, f"an engine may be at {where}, but the docker SDK is missing: "
                            "pip install 'miles-agent[docker]'")
        else:
            try:
                client = docker.APIClient(base_url=where, version="auto", timeout=5)
                client.ping()
                client.close()
                found = (True, f"the container engine at {where}")
            except Exception as e:  # noqa: BLE001 - any failure to answer means unreachable
                found = (False, f"the container engine at {where} does not answer ({type(e).__name__}: {e})")
    _engine_cache[where] = found
    return found


class AutoSandbox(Sandbox):
    """Routes each episode to ``local`` or ``docker`` by what its spec needs (see the module docstring)."""

    name = "auto"
    description = "local when the task runs faithfully on this host, else docker when an engine is reachable"
    options_type: ClassVar[type] = AutoSandboxOptions

    def __init__(self, *, local: dict[str, Any] | None = None, docker: dict[str, Any] | None = None,
                 network: str = "task") -> None:
        self._options = {"local": dict(local or {}), "docker": dict(docker or {})}
        for backend, options in self._options.items():
            if options:  # a typo in a backend's options fails now, as env.sandbox_options does
                sandbox_factory(backend, options)
        self._network = network
        self._inner: Sandbox | None = None
        self.route: dict[str, str] | None = None  # {"backend": ..., "reason": ...} once started

    @staticmethod
    def container_engine_of(options: dict[str, Any] | None = None) -> tuple[bool, str]:
        """`container_engine` for ``auto``'s options (what environments ask before routing)."""
        return container_engine(options)

    async def start(self, spec: SandboxSpec) -> None:
        if spec.image is None and spec.build is None:
            backend, reason = "local", "the task needs only this host's tools"
        else:
            what = spec.image or f"an image built from {spec.build.context}"  # type: ignore[union-attr]
            ok, where = container_engine(self._options)
            if not ok:
                raise UserError(f"auto sandbox: the task needs its container ({what}), but {where}")
            backend, reason = "docker", f"the task needs its container ({what}); {where}"
        self.route = {"backend": backend, "reason": reason}
        log.info("auto sandbox: %s, because %s", backend, reason)
        cls = registry.load("sandboxes", backend, key="env.sandbox")
        options = dict(self._options[backend])
        policy = {f.name: f.default for f in dataclasses.fields(cls.options_type)} if cls.options_type else {}
        if isinstance(policy.get("network"), str):  # the backend takes the same network policy
            options.setdefault("network", self._network)
        self._inner = sandbox_factory(backend, options)()
        await self._inner.start(spec)

    def _sandbox(self) -> Sandbox:
        if self._inner is None:
            raise SandboxError("auto sandbox: not started; call start() first")
        return self._inner

    async def exec(self, command: str, *, timeout_s: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        return await self._sandbox().exec(command, timeout_s=timeout_s, cwd=cwd, env=env)

    async def read_file(self, path: str) -> bytes:
        return await self._sandbox().read_file(path)

    async def write_file(self, path: str, content: bytes) -> None:
        await self._sandbox().write_file(path, content)

    async def run_verifier(self, run: VerifierRun) -> VerifierResult:
        return await self._sandbox().run_verifier(run)

    async def end_agent_processes(self) -> None:
        await self._sandbox().end_agent_processes()

    async def stop(self) -> None:
        if self._inner is not None:
            await self._inner.stop()
