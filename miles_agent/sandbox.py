"""The sandbox contract: where an agent's actions run.

Backends live in ``sandboxes/`` (installed as ``miles_agent.sandboxes``): ``local`` (bubblewrap-isolated
subprocesses, the embedded default), later Docker, E2B, Modal, Daytona. An episode owns its sandbox
from ``start`` until its verifier has run; ``stop`` must leave nothing running.

Torch-free on purpose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from miles_agent.errors import InfraError


@dataclass(frozen=True)
class SandboxLimits:
    """Per-command limits. Every backend enforces what it can and reports which limit ended a command."""

    wall_time_s: float = 30.0  # kills the whole process tree
    cpu_time_s: int = 60
    memory_bytes: int = 1 << 30
    max_processes: int = 256
    max_file_bytes: int = 256 << 20
    max_output_bytes: int = 1 << 20  # stdout and stderr, each; the rest is dropped and marked


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    output_truncated: bool = False
    limit_hit: str | None = None  # "wall_time", "cpu_time", "memory", "output", ... when a limit ended it


@dataclass
class SandboxSpec:
    """What an environment asks of a sandbox for one episode."""

    image: str | None = None  # a container image; the local backend refuses tasks that need one
    files: dict[str, bytes] = field(default_factory=dict)  # workspace-relative path -> content
    env: dict[str, str] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)


class SandboxError(InfraError):
    """The sandbox itself failed (not the command inside it): the episode is retried, never scored 0."""


class Sandbox(ABC):
    """One isolated workspace. Async so that many episodes share an event loop."""

    name: str = "abstract"
    description: str = ""

    @abstractmethod
    async def start(self, spec: SandboxSpec) -> None: ...

    @abstractmethod
    async def exec(self, command: str, *, timeout_s: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        """Run a shell command inside the sandbox (``bash -c``)."""

    @abstractmethod
    async def read_file(self, path: str) -> bytes: ...

    @abstractmethod
    async def write_file(self, path: str, content: bytes) -> None: ...

    @abstractmethod
    async def stop(self) -> None:
        """Kill everything still running and release the workspace. Safe to call twice."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
