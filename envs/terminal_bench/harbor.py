"""A reader for Harbor task directories, written against the format rather than by importing harbor.

Why not import harbor: it needs Python >= 3.12 and a container runtime, while environment workers
must run anywhere (CPU nodes, laptops, another Python). The reader takes what an episode needs:

    task.toml        [metadata] difficulty/category/tags, [verifier]/[agent]/[solution] timeout_sec
                     and env, [environment] docker_image / memory_mb / env (both old "version" and
                     new "schema_version" + [task] layouts are accepted)
    instruction.md   the prompt, verbatim
    environment/     a Dockerfile (optional here) and the files the Dockerfile copies in
    tests/test.sh    the verifier; writes a number to /logs/verifier/reward.txt (or reward.json)
    solution/solve.sh  the oracle (optional)

A task runs in the local sandbox when it needs nothing but files: no ``docker_image``, no compose
file, and a Dockerfile (if any) made only of FROM/WORKDIR/COPY/ADD/ENV/ARG/LABEL/USER lines. Anything
else (a RUN that installs packages, services, GPUs) needs the task's own container image; such tasks
are still parsed and listed, with the reasons, so the caller can route or refuse them.

Symlinks. A task set is downloaded, so a link in it is untrusted: followed on the host, it would copy
``~/.ssh`` or a token into the sandbox and from there into logged trajectories. Every file is staged
through `staged_files`, which allows a link only when its fully resolved target lies inside the task
folder and refuses any other (absolute, ``..``, a chain leaving the folder, dangling, a loop) with a
`TaskSymlinkError` at load time. Only regular files and folders are staged: a FIFO would hang the
loader and a device node (tar keeps them when root unpacks) would read the host's device.
"""

from __future__ import annotations

import errno
import math
import os
import posixpath
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError

#: Files in environment/ that describe the image and are never copied into the workspace.
IMAGE_FILES = frozenset({"Dockerfile", ".dockerignore", "docker-compose.yaml", "docker-compose.yml"})
#: Dockerfile instructions the local sandbox can honour without building an image.
LOCAL_INSTRUCTIONS = frozenset({"FROM", "WORKDIR", "COPY", "ADD", "ENV", "ARG", "LABEL", "USER",
                                "MAINTAINER", "CMD", "ENTRYPOINT", "SHELL"})
DEFAULT_TIMEOUT_S = 600.0  # Harbor's default for both the agent and the verifier


class TaskFormatError(UserError):
    """A task directory that does not follow the Harbor format. The message names the file and the fix."""


class TaskSymlinkError(TaskFormatError):
    """A symlink in a task folder that leads out of it (or nowhere): staging it would copy a host file."""


@dataclass(frozen=True)
class HarborTask:
    """One parsed Harbor task: everything an episode needs, read once from disk."""

    name: str
    path: Path
    instruction: str
    difficulty: str = "unknown"
    category: str = ""
    tags: tuple[str, ...] = ()
    split: str | None = None  # None = the task belongs to every split
    agent_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int | None = None
    docker_image: str | None = None
    workdir: str | None = None  # the Dockerfile's WORKDIR; mapped onto the sandbox workspace
    env: dict[str, str] = field(default_factory=dict)  # [environment] env + Dockerfile ENV
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # workspace-relative path -> source file
    container_reasons: tuple[str, ...] = ()  # why the task needs its own image; empty = runs locally
    # Read for container backends: [environment] network_mode = "public" / allow_internet = true (an explicit
    # request), cpus, workdir (overrides the image's WORKDIR) and env alone (without the Dockerfile's ENV,
    # which a built image applies itself).
    network: bool = False
    cpus: float | None = None
    workdir_override: str | None = None
    environment_env: dict[str, str] = field(default_factory=dict)

    @property
    def needs_container(self) -> bool:
        return bool(self.container_reasons)

    @property
    def has_solution(self) -> bool:
        return (self.path / "solution" / "solve.sh").is_file()


# -- small typed getters: each bad value is reported with its file and key -------------------------

def _table(data: dict[str, Any], key: str, where: Path) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise TaskFormatError(f"{where}: [{key}] must be a table, got {type(value).__name__}; "
                              f"write it as a [{key}] section")
    return value


def _timeout(section: dict[str, Any], name: str, where: Path) -> float:
    value = section.get("timeout_sec", DEFAULT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise TaskFormatError(f"{where}: [{name}] timeout_sec must be a positive number of seconds, "
                              f"got {value!r}; e.g. timeout_sec = 120.0")
    return float(value)


def _str_map(section: dict[str, Any], name: str, where: Path) -> dict[str, str]:
    value = section.get("env", {})
    if not isinstance(value, dict) or not all(isinstance(v, str | int | float | bool) for v in value.values()):
        raise TaskFormatError(f"{where}: [{name}] env must be a table of strings, e.g. "
                              f'env = {{ NAME = "value" }}; got {value!r}')
    return {str(k): str(v) for k, v in value.items()}


def _memory_mb(env_section: dict[str, Any], where: Path) -> int | None:
    if "memory_mb" in env_section:
        value = env_section["memory_mb"]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TaskFormatError(f"{where}: [environment] memory_mb must be a positive integer, got {value!r}")
        return value
    text = env_section.get("memory")
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise TaskFormatError(f"{where}: [environment] memory = {text!r} is not a size; write e.g. \"2G\"")
    scale = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[m.group(2).upper()]
    return max(1, int(float(m.group(1)) * scale))


def _tags(meta: dict[str, Any], task_section: dict[str, Any], where: Path) -> tuple[str, ...]:
    value = meta.get("tags", task_section.get("keywords", []))
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskFormatError(f"{where}: tags must be a list of strings, e.g. tags = [\"text\", \"csv\"]")
    return tuple(value)


# -- staging files from the host: links may not leave the task folder -----------------------------

_LINK_FIX = "replace the link with a copy of the file inside the task folder"


def resolved_inside(path: Path, task_root: Path) -> Path:
    """``path`` with every symlink in it resolved, or TaskSymlinkError if that leaves ``task_root``.

    A path without links is returned resolved as well; one that does not exist (and is no link)
    raises FileNotFoundError, which callers turn into their own "missing" message."""
    root = task_root.resolve()
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        if not os.path.lexists(path) and not _has_link(path, task_root):
            raise
        raise TaskSymlinkError(f"{path} is a symlink to {_link_text(path)}, which does not exist; "
                               f"{_LINK_FIX}") from None
    except RuntimeError as e:  # a symlink loop, as Python before 3.13 reports it
        raise TaskSymlinkError(f"{path} is a symlink loop ({e}); {_LINK_FIX}") from None
    except OSError as e:
        if e.errno != errno.ELOOP:  # a loop, as Python 3.13 reports it; anything else is not ours to word
            raise
        raise TaskSymlinkError(f"{path} is a symlink loop ({e}); {_LINK_FIX}") from None
    if not target.is_relative_to(root):
        raise TaskSymlinkError(f"{path} is a symlink to {_link_text(path)} (resolving to {target}), outside "
                               f"the task folder {root}; staging it would copy a host file into the "
                               f"sandbox; {_LINK_FIX}")
    return target


def _has_link(path: Path, task_root: Path) -> bool:
    """Whether a folder on ``path`` below ``task_root`` (both as given, compared by name) is a symlink:
    then a missing file is the link's fault, not a typo."""
    return any(p.is_symlink() for p in path.parents if p.is_relative_to(task_root) and p != task_root)


def _link_text(path: Path) -> str:
    """What the link says (its first hop), for the message; a chain is named by the resolved path too."""
    try:
        return repr(os.readlink(path))
    except OSError:  # not itself a link: a folder above it is
        return "a path through a linked folder"


def staged_files(folder: Path, task_root: Path) -> list[tuple[str, Path]]:
    """Every regular file under ``folder``, as (folder-relative POSIX path, resolved real path), sorted.

    The one way to read a task folder's files on the host. Symlinks are not followed blindly: a link
    whose fully resolved target lies inside ``task_root`` is staged as its target (a file's content,
    a folder walked; a folder link back to one of its own ancestors is refused as a loop); any other
    link (absolute, ``..``, a chain leaving the folder, dangling) raises TaskSymlinkError naming the
    link, its target and the fix. FIFOs, sockets and device nodes raise TaskFormatError. A ``folder``
    that does not exist holds no files. Read the returned paths, not ``folder / rel``: they are the
    checked targets."""
    if not os.path.lexists(folder):
        return []
    real = resolved_inside(folder, task_root)
    if not real.is_dir():
        raise TaskFormatError(f"{folder} must be a folder; move the file into a folder of that name")
    out: list[tuple[str, Path]] = []
    _walk(real, "", task_root.resolve(), frozenset({real}), out)
    return out


def _walk(real_dir: Path, rel: str, root: Path, ancestors: frozenset[Path], out: list[tuple[str, Path]]) -> None:
    """Depth-first over ``real_dir`` (already resolved, so only each entry itself can be a link)."""
    with os.scandir(real_dir) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            path, name = Path(entry.path), f"{rel}/{entry.name}" if rel else entry.name
            target = resolved_inside(path, root) if entry.is_symlink() else path
            if target.is_dir():
                if target in ancestors:
                    raise TaskSymlinkError(f"{path} links back to its own folder {target} (a loop); {_LINK_FIX}")
                _walk(target, name, root, ancestors | {target}, out)
            elif target.is_file():
                out.append((name, target))
            else:
                raise TaskFormatError(f"{path} is not a regular file or folder (a FIFO, socket or device); "
                                      "remove it from the task folder")


# -- the Dockerfile: what the local sandbox can reproduce ------------------------------------------

@dataclass
class _DockerPlan:
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[str, str]] = field(default_factory=list)  # (context-relative source, destination)
    reasons: list[str] = field(default_factory=list)


def _dockerfile_lines(text: str) -> list[str]:
    """Instructions with line continuations joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending.strip():
        out.append(pending)
    return out


def _parse_env(args: str) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # legacy "ENV NAME value with spaces"
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts if "=" in p)


def plan_dockerfile(text: str) -> _DockerPlan:
    """Read a Dockerfile as a recipe for the local sandbox; anything it cannot honour becomes a reason."""
    plan = _DockerPlan()
    for line in _dockerfile_lines(text):
        word, _, args = line.partition(" ")
        op = word.upper()
        if op not in LOCAL_INSTRUCTIONS:
            plan.reasons.append(f"its Dockerfile has `{line[:60]}`")
        elif op == "WORKDIR":
            plan.workdir = posixpath.normpath(posixpath.join(plan.workdir or "/", args.strip()))
        elif op == "ENV":
            plan.env.update(_parse_env(args))
        elif op in ("COPY", "ADD"):
            _plan_copy(plan, args)
    return plan


def _plan_copy(plan: _DockerPlan, args: str) -> None:
    parts = [p for p in shlex.split(args) if not p.startswith("--")]
    flags = [p for p in shlex.split(args) if p.startswith("--")]
    if len(parts) < 2 or any(f.startswith("--from") for f in flags) or "://" in args:
        plan.reasons.append(f"its Dockerfile copies from outside the build context (`{args[:60]}`)")
        return
    *sources, dest = parts
    into_dir = dest.endswith("/")
    dest = posixpath.normpath(posixpath.join(plan.workdir or "/", dest))
    dest = dest + "/" if into_dir and dest != "/" else dest
    for src in sources:
        plan.copies.append((src, dest))


def _workspace_files(task_dir: Path, plan: _DockerPlan | None, where: Path) -> dict[str, Path]:
    """Workspace-relative path -> file. Without a Dockerfile every file in environment/ is copied."""
    env_dir = task_dir / "environment"
    if not env_dir.is_dir():
        return {}
    if plan is None:
        return {rel: p for rel, p in staged_files(env_dir, task_dir) if posixpath.basename(rel) not in IMAGE_FILES}
    files: dict[str, Path] = {}
    root = (plan.workdir or "/").rstrip("/")
    for src, dest in plan.copies:
        if not (dest.rstrip("/") + "/").startswith(root + "/"):
            plan.reasons.append(f"its Dockerfile copies {src} to {dest}, outside WORKDIR {root or '/'}")
            continue
        rel = dest.rstrip("/")[len(root):].strip("/")
        sources = _copy_sources(task_dir, src, where)
        for source in sources:
            if source.is_dir():
                for sub, p in staged_files(source, task_dir):
                    if posixpath.basename(sub) not in IMAGE_FILES:
                        files[f"{rel}/{sub}".lstrip("/")] = p
            elif source.name not in IMAGE_FILES:
                into_dir = dest.endswith("/") or len(sources) > 1 or not rel
                files[f"{rel}/{source.name}".lstrip("/") if into_dir else rel] = source
    return files


def _copy_sources(task_dir: Path, src: str, where: Path) -> list[Path]:
    """The resolved files/folders a COPY source names; they must lie in environment/ (Docker's build
    context), and a link among them may not leave the task folder."""
    env_dir = task_dir / "environment"
    context = env_dir.resolve()
    matches = sorted(env_dir.glob(src)) if any(c in src for c in "*?[") else [env_dir / src]
    resolved = []
    for match in matches:
        try:
            source = resolved_inside(match, task_dir)
        except FileNotFoundError:
            source = None
        if source is None or not source.is_relative_to(context):
            raise TaskFormatError(f"{where.parent / 'environment' / 'Dockerfile'}: COPY source {src!r} is "
                                  f"not in {env_dir}; add it there or fix the COPY line")
        resolved.append(source)
    return resolved


# -- the task -------------------------------------------------------------------------------------

def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        if (path.parent / "task.yaml").is_file():
            raise TaskFormatError(f"{path.parent}: has task.yaml, the older Terminal-Bench 1 format; convert it "
                                  "to Harbor's (task.toml, instruction.md, tests/test.sh) with Harbor's "
                                  "terminal-bench adapter")
        raise TaskFormatError(f"{path} is missing; every Harbor task directory needs a task.toml "
                              "(it may be as short as: version = \"1.0\")")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskFormatError(f"{path} is not valid TOML ({e}); fix the syntax at that position") from None


def _read_instruction(task_dir: Path) -> str:
    path = task_dir / "instruction.md"
    if not path.is_file():
        raise TaskFormatError(f"{path} is missing; write the task's prompt for the agent there")
    text = path.read_text(encoding="utf-8").strip()
    if not text:
        raise TaskFormatError(f"{path} is empty; write the task's prompt for the agent there")
    return text


def _container_plan(task_dir: Path, env_section: dict[str, Any]) -> tuple[_DockerPlan | None, list[str]]:
    reasons: list[str] = []
    image = env_section.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise TaskFormatError(f"{task_dir / 'task.toml'}: [environment] docker_image must be an image name "
                              f"such as \"python:3.12-slim\", got {image!r}")
    if image:
        reasons.append(f"it names its own image ({image})")
    for compose in ("docker-compose.yaml", "docker-compose.yml"):
        if (task_dir / "environment" / compose).is_file():
            reasons.append(f"it starts services (environment/{compose})")
    gpus = env_section.get("gpus", 0)
    if isinstance(gpus, int) and gpus > 0:
        reasons.append(f"it asks for {gpus} GPU(s)")
    dockerfile = task_dir / "environment" / "Dockerfile"
    plan = plan_dockerfile(dockerfile.read_text(encoding="utf-8")) if dockerfile.is_file() else None
    return plan, reasons


def load_task(task_dir: str | Path) -> HarborTask:
    """Parse one Harbor task directory, or raise TaskFormatError naming the file and the fix.

    Every file in it is checked first (`staged_files`): a symlink leaving the folder fails the load,
    so a bad task set is refused before any episode, and ``instruction.md`` or ``task.toml`` cannot
    be a host file either (the prompt is logged with every trajectory)."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise TaskFormatError(f"{task_dir} is not a directory; pass a Harbor task directory")
    toml_path = task_dir / "task.toml"
    if os.path.lexists(toml_path):  # a task folder: check every link in it before any file is read
        staged_files(task_dir, task_dir)
    data = _read_toml(toml_path)
    instruction = _read_instruction(task_dir)
    if not (task_dir / "tests" / "test.sh").is_file():
        raise TaskFormatError(f"{task_dir / 'tests' / 'test.sh'} is missing; the verifier must write a "
                              "number to /logs/verifier/reward.txt")
    meta = _table(data, "metadata", toml_path)
    task_section = _table(data, "task", toml_path)
    env_section = _table(data, "environment", toml_path)
    verifier, agent = _table(data, "verifier", toml_path), _table(data, "agent", toml_path)
    plan, reasons = _container_plan(task_dir, env_section)
    files = _workspace_files(task_dir, plan, toml_path)
    if plan is not None:
        reasons += plan.reasons
    split = data.get("split", meta.get("split"))
    if split is not None and not isinstance(split, str):
        raise TaskFormatError(f"{toml_path}: split must be a string such as \"train\", got {split!r}")
    return HarborTask(
        name=task_dir.name, path=task_dir, instruction=instruction,
        difficulty=str(meta.get("difficulty", "unknown")), category=str(meta.get("category", "")),
        tags=_tags(meta, task_section, toml_path), split=split,
        agent_timeout_s=_timeout(agent, "agent", toml_path),
        verifier_timeout_s=_timeout(verifier, "verifier", toml_path),
        memory_mb=_memory_mb(env_section, toml_path), docker_image=env_section.get("docker_image") or None,
        workdir=plan.workdir if plan else None,
        env={**(plan.env if plan else {}), **_str_map(env_section, "environment", toml_path)},
        verifier_env=_str_map(verifier, "verifier", toml_path),
        solution_env=_str_map(_table(data, "solution", toml_path), "solution", toml_path),
        files=files, container_reasons=tuple(reasons),
        network=_network_request(env_section, toml_path), cpus=_cpus(env_section, toml_path),
        workdir_override=_workdir_override(env_section, toml_path),
        environment_env=_str_map(env_section, "environment", toml_path))


def _network_request(env_section: dict[str, Any], where: Path) -> bool:
    """Whether the task explicitly asks for the network: ``network_mode = "public"`` (or "allowlist",
    which needs it) or the older ``allow_internet = true``."""
    mode = env_section.get("network_mode")
    if mode is not None and mode not in ("public", "no-network", "allowlist"):
        raise TaskFormatError(f"{where}: [environment] network_mode must be \"public\", \"no-network\" or "
                              f"\"allowlist\", got {mode!r}")
    allow = env_section.get("allow_internet")
    if allow is not None and not isinstance(allow, bool):
        raise TaskFormatError(f"{where}: [environment] allow_internet must be true or false, got {allow!r}")
    return mode in ("public", "allowlist") or (mode is None and allow is True)


def _cpus(env_section: dict[str, Any], where: Path) -> float | None:
    value = env_section.get("cpus")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise TaskFormatError(f"{where}: [environment] cpus must be a positive number, got {value!r}")
    return float(value)


def _workdir_override(env_section: dict[str, Any], where: Path) -> str | None:
    value = env_section.get("workdir")
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise TaskFormatError(f"{where}: [environment] workdir must be an absolute path such as \"/app\", "
                              f"got {value!r}")
    return posixpath.normpath(value)


def load_tasks(tasks_dir: str | Path) -> list[HarborTask]:
    """Every task under ``tasks_dir`` (a folder of task directories, or one task directory), by name."""
    root = Path(tasks_dir).expanduser()
    if not root.is_dir():
        raise TaskFormatError(f"tasks folder {root} does not exist; pass a folder of Harbor task directories")
    if (root / "task.toml").is_file():
        return [load_task(root)]
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    if not dirs:
        raise TaskFormatError(f"tasks folder {root} holds no task directories; each task is a folder "
                              "with task.toml, instruction.md and tests/test.sh")
    return [load_task(d) for d in dirs]
