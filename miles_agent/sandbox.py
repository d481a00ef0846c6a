"""The sandbox contract: where an agent's actions run.

Backends live in ``sandboxes/`` (installed as ``miles_agent.sandboxes``): ``local`` (bubblewrap-isolated
subprocesses, the embedded default), later Docker, E2B, Modal, Daytona. An episode owns its sandbox
from ``start`` until its verifier has run; ``stop`` must leave nothing running.

Torch-free on purpose.
"""

from __future__ import annotations

import posixpath
import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from miles_agent.errors import InfraError


@dataclass(frozen=True)
class SandboxLimits:
    """Limits per command, and the storage quota of the whole sandbox. Every backend enforces what it
    can and reports which limit ended a command (docs/sandboxes.md has each backend's table)."""

    wall_time_s: float = 30.0  # kills the whole process tree
    cpu_time_s: int = 60
    memory_bytes: int = 1 << 30  # address space, per process
    max_processes: int = 256
    max_file_bytes: int = 256 << 20
    max_output_bytes: int = 1 << 20  # stdout and stderr, each; the rest is dropped and marked
    max_open_files: int = 1024  # RLIMIT_NOFILE per process: x max_processes bounds the sandbox's files
    disk_bytes: int = 1 << 30  # everything the agent can write (workspace, /tmp, home), together
    disk_inodes: int = 131072  # files, folders and links in that storage


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    output_truncated: bool = False
    limit_hit: str | None = None  # "wall_time", "cpu_time", "memory", "output", ... when a limit ended it


@dataclass(frozen=True)
class ImageBuild:
    """An image a container backend builds (not pulls) before the episode: ``context`` is a host folder
    (a Harbor task's environment/), ``dockerfile`` a path inside it. Backends cache builds by a hash of
    the context's content, so a task set builds each distinct environment once."""

    context: str
    dockerfile: str = "Dockerfile"
    build_args: dict[str, str] = field(default_factory=dict)


@dataclass
class SandboxSpec:
    """What an environment asks of a sandbox for one episode."""

    image: str | None = None  # a container image to run; the local backend refuses tasks that need one
    build: ImageBuild | None = None  # build this image instead (container backends); ``image`` then unused
    files: dict[str, bytes] = field(default_factory=dict)  # path -> content: relative to ``workdir``, or absolute
    env: dict[str, str] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    # The default cwd of every exec (an image's WORKDIR, e.g. /app), at that real path. None = the
    # backend's own workspace (/workspace).
    workdir: str | None = None
    # The task asked for the network (Harbor ``network_mode = "public"`` / ``allow_internet``). Backends
    # honour it unless their operator option forbids it, and then log a warning naming the task's request.
    network: bool = False
    cpus: float | None = None  # CPU share, where the backend can limit it (containers)


class SandboxError(InfraError):
    """The sandbox itself failed (not the command inside it): the episode is retried, never scored 0."""


# PYTHONSAFEPATH: no cwd on sys.path, so a json.py the agent left in its workdir cannot stand in for the
# stdlib's. A verifier that must import the agent's package from its cwd sets PYTHONSAFEPATH="" in run.env.
VERIFIER_PYTHON_ENV = {"PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class VerifierRun:
    """A verifier to run on the state the agent left: files placed at absolute paths first (e.g. the
    task's /tests), then ``command``, then the files it wrote into ``output_dir`` read back.

    The backend stages the files where the agent cannot have interfered, gives the command a fresh
    home and /tmp and Python without user site or a script/cwd entry on its import path
    (`VERIFIER_PYTHON_ENV`), and clears ``output_dir`` so nothing the agent forged there survives."""

    command: str
    files: dict[str, bytes]  # absolute path -> content
    output_dir: str = "/logs/verifier"
    outputs: tuple[str, ...] = ()  # names in output_dir to read back (missing ones are left out)
    timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    max_output_file_bytes: int = 1 << 20
    # Host folders the verifier sees read-only at the given absolute paths (sandbox path -> host folder),
    # e.g. a provisioned offline toolchain (uv and a wheel cache). The agent never sees them.
    host_dirs: dict[str, str] = field(default_factory=dict)
    # False: what ran before stays up for the tests (Harbor's semantics). Only for commands as trusted as
    # the tests (the task's own solve.sh); a policy's leftovers could rewrite the reward file meanwhile.
    end_agent_processes: bool = True


@dataclass
class VerifierResult:
    """What the verifier did. ``setup_error`` set: it could not even start because of the state the agent
    left (a full quota, a folder it locked): the agent's failure, to be scored 0 -- never retried."""

    result: ExecResult | None
    outputs: dict[str, bytes] = field(default_factory=dict)
    setup_error: str | None = None


class Sandbox(ABC):
    """One isolated workspace. Async so that many episodes share an event loop."""

    name: str = "abstract"
    description: str = ""
    #: The backend's ``env.sandbox_options``: a frozen dataclass whose fields are constructor keywords.
    #: The build step checks the options against it before any model loads; None: passed unchecked.
    options_type: ClassVar[type | None] = None

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

    async def run_verifier(self, run: VerifierRun) -> VerifierResult:
        """Run a verifier after the agent (see `VerifierRun`). This default works on backends whose file
        API takes absolute paths (containers, cloud sandboxes), where the agent is root in its own
        machine: its folders are removed and made afresh as root first, and a step that fails because
        of what the agent left is a `setup_error`. A `SandboxError` (the backend itself failed) still
        propagates. The local sandbox overrides it with staging from the host side."""
        if run.end_agent_processes:
            await self.end_agent_processes()
        dirs = sorted({run.output_dir, *(posixpath.dirname(p) for p in run.files)})
        roots = sorted({"/" + p.strip("/").split("/")[0] for p in [*run.files, run.output_dir]})
        fresh = "/tmp/.miles-verifier"
        setup = (f"rm -rf {' '.join(map(shlex.quote, [*roots, fresh]))} && "
                 f"mkdir -p {' '.join(map(shlex.quote, [*dirs, fresh + '/home', fresh + '/tmp']))}")
        prepared = await self.exec(setup, timeout_s=120)
        if prepared.exit_code != 0:
            return VerifierResult(None, setup_error=f"preparing {', '.join(roots)}: {_tail(prepared)}")
        try:
            for path, content in run.files.items():
                await self.write_file(path, content)
        except (PermissionError, IsADirectoryError, NotADirectoryError, FileNotFoundError) as e:
            return VerifierResult(None, setup_error=f"staging the verifier's files: {e}")
        env = {**VERIFIER_PYTHON_ENV, "HOME": fresh + "/home", "TMPDIR": fresh + "/tmp", **run.env}
        result = await self.exec(run.command, timeout_s=run.timeout_s, env=env)
        # Which outputs exist, asked first: remote backends report a missing file as a SandboxError.
        names = " ".join(shlex.quote(n) for n in run.outputs)
        listed = await self.exec(f"cd {shlex.quote(run.output_dir)} 2>/dev/null && for n in {names}; do "
                                 '[ -f "$n" ] && [ ! -L "$n" ] && echo "$n"; done; true', timeout_s=30)
        outputs = {}
        for name in (n for n in listed.stdout.splitlines() if n in run.outputs):
            try:
                data = await self.read_file(posixpath.join(run.output_dir, name))
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
                continue
            outputs[name] = data[:run.max_output_file_bytes]
        return VerifierResult(result, outputs)

    async def end_agent_processes(self) -> None:
        """Kill what the agent left running (a loop rewriting the reward file) before a verifier runs.
        Backends that can tell the agent's processes from their own override it; the local sandbox needs
        nothing (a command's processes die with it). The cost: a service the agent started is down
        when the tests look for it -- tests must start what they check."""
        return None

    @abstractmethod
    async def stop(self) -> None:
        """Kill everything still running and release the workspace. Safe to call twice."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _tail(result: ExecResult) -> str:
    return f"exit {result.exit_code}: {(result.stderr or result.stdout).strip()[-300:]}"
