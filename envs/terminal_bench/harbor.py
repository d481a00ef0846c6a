"""A reader for Harbor task directories, written against the format rather than by importing harbor.

Why not import harbor: it needs Python >= 3.12 and a container runtime, while environment workers
must run anywhere (CPU nodes, laptops, another Python). The reader takes what an episode needs:

    task.toml        [metadata] difficulty/category/tags, [verifier]/[agent]/[solution] timeout_sec
                     and env, [environment] docker_image / memory_mb / cpus / env / workdir /
                     network_mode / allow_internet (both old "version" and new "schema_version" +
                     [task] layouts are accepted)
    instruction.md   the prompt, verbatim
    environment/     a Dockerfile (optional here) and the files it copies in, or a docker-compose.yaml
                     with one service (its build, environment, working_dir, network_mode)
    tests/test.sh    the verifier; writes a number to /logs/verifier/reward.txt (or reward.json)
    solution/solve.sh  the oracle (optional)

A task runs in the local sandbox when its image can be reproduced on this host (``dockerfile``: ENV,
WORKDIR, COPY, and RUN steps that need only host tools, run as setup commands before the agent).
Anything else (a RUN that installs packages, several services, a prebuilt image, GPUs) needs the
task's own container image; such tasks are still parsed and listed, with the reasons
(``container_reasons``), so the caller can route or refuse them.

Symlinks. A task set is downloaded, so a link in it is untrusted: followed on the host, it would copy
``~/.ssh`` or a token into the sandbox and from there into logged trajectories. Every file is staged
through `staged_files`, which allows a link only when its fully resolved target lies inside the task
folder and refuses any other (absolute, ``..``, a chain leaving the folder, dangling, a loop) with a
`TaskSymlinkError` at load time. Only regular files and folders are staged: a FIFO would hang the
loader and a device node (tar keeps them when root unpacks) would read the host's device.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import posixpath
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError

from . import dockerfile
from .dockerfile import BASE_ENV, HOST_PATH, ComposeService, DockerPlan, SetupStep, read_compose

#: Files in environment/ that describe the image and are never copied into the workspace.
IMAGE_FILES = frozenset({"Dockerfile", ".dockerignore", "docker-compose.yaml", "docker-compose.yml"})
#: Top-level folders the local sandbox shows read-only from the host (a working directory there needs an image).
SYSTEM_TOPS = frozenset({"usr", "etc", "proc", "dev", "sys", "bin", "sbin", "lib", "lib32", "lib64", "libx32"})
DEFAULT_TIMEOUT_S = 600.0
BASE_BIN = Path(__file__).parent / "base_bin"  # commands base images have and this host may lack
PYTHON_SHIM = "/opt/miles-agent/base-bin/python"  # Harbor's default for both the agent and the verifier


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
    # The default cwd at its real path: [environment] workdir, the compose service's working_dir, or the
    # Dockerfile's final WORKDIR; None: none given (the sandbox's own workspace).
    workdir: str | None = None
    # Dockerfile ENV (expanded as Docker does, ``${PATH}`` against the base image's), then the compose
    # service's environment, then [environment] env.
    env: dict[str, str] = field(default_factory=dict)
    network: bool = False  # the task asks for the network (network_mode / allow_internet / compose)
    cpus: float | None = None  # [environment] cpus, or the compose service's
    compose: ComposeService | None = None  # the single service of environment/docker-compose.yaml
    build_context: Path | None = None  # the image's build context (environment/, or the compose build's)
    dockerfile: str | None = None  # its Dockerfile, relative to build_context; None: no Dockerfile
    setup: tuple[SetupStep, ...] = ()  # RUN steps the local sandbox runs before the agent, in order
    workdirs: tuple[str, ...] = ()  # every WORKDIR the Dockerfile creates
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # workdir-relative or absolute path -> source file
    container_reasons: tuple[str, ...] = ()  # why the task needs its own image; empty = runs locally
    # For container backends, which build the image and so apply its Dockerfile themselves: [environment]
    # workdir alone (it overrides the image's WORKDIR) and [environment] env alone (the Dockerfile's ENV must
    # not override the built image's own expanded PATH).
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


# -- the image's files: what COPY puts where ------------------------------------------------------

def image_files(task_dir: Path, plan: DockerPlan | None, where: Path, context: Path | None = None,
                workdir: str | None = None) -> dict[str, Path]:
    """Path -> file: relative to the final ``workdir`` where it lies inside it, else absolute. Without
    a Dockerfile every file in environment/ is copied into the workdir."""
    context_dir = context or task_dir / "environment"
    if not context_dir.is_dir():
        return {}
    if plan is None:
        return {rel: p for rel, p in staged_files(context_dir, task_dir) if posixpath.basename(rel) not in IMAGE_FILES}
    files: dict[str, Path] = {}
    root = (workdir or plan.workdir or "/").rstrip("/")
    for src, dest in plan.copies:
        sources = _copy_sources(task_dir, context_dir, src, where)
        for source in sources:
            into_dir = dest.endswith("/") or len(sources) > 1 or source.is_dir()
            base = dest.rstrip("/") or "/"
            if source.is_dir():
                items = [(posixpath.join(base, sub), p) for sub, p in staged_files(source, task_dir)]
            else:
                items = [(posixpath.join(base, source.name) if into_dir else base, source)]
            for target, p in items:
                if posixpath.basename(target) in IMAGE_FILES:
                    continue
                inside = root and (target + "/").startswith(root + "/")
                files[target[len(root):].lstrip("/") if inside else target] = p
    return files


def plan_dockerfile(text: str) -> DockerPlan:
    """A Dockerfile read as a recipe for the local sandbox (see `dockerfile.plan_dockerfile`)."""
    return dockerfile.plan_dockerfile(text)


def _copy_sources(task_dir: Path, context_dir: Path, src: str, where: Path) -> list[Path]:
    """The resolved files/folders a COPY source names; they must lie in the build context, and a link
    among them may not leave the task folder."""
    context = context_dir.resolve()
    src = src.rstrip("/") or "."
    matches = sorted(context_dir.glob(src)) if any(c in src for c in "*?[") else [context_dir / src]
    resolved = []
    for match in matches:
        try:
            source = resolved_inside(match, task_dir)
        except FileNotFoundError:
            source = None
        if source is None or not source.is_relative_to(context):
            raise TaskFormatError(f"{where.parent / 'environment' / 'Dockerfile'}: COPY source {src!r} is "
                                  f"not in {context_dir}; add it there or fix the COPY line")
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
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as e:
        raise TaskFormatError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                              "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if not text:
        raise TaskFormatError(f"{path} is empty; write the task's prompt for the agent there")
    return text


NETWORK_MODES = {"public": True, "allowlist": True, "no-network": False}


def _network(data: dict[str, Any], env_section: dict[str, Any], compose: ComposeService | None,
             where: Path) -> bool:
    """Whether the task asks for the network: ``network_mode`` ("public"/"allowlist") of [environment],
    [agent] or [verifier], the older ``allow_internet``, or its compose service's ``network_mode``.
    Unsaid: no network (Harbor's own default is public; here a task must ask)."""
    asks = []
    for section in (env_section, _table(data, "agent", where), _table(data, "verifier", where)):
        mode = section.get("network_mode")
        if mode is not None:
            if mode not in NETWORK_MODES:
                raise TaskFormatError(f"{where}: network_mode = {mode!r} is not one of "
                                      f"{', '.join(map(repr, NETWORK_MODES))}")
            asks.append(NETWORK_MODES[mode])
    if "allow_internet" in env_section:
        if not isinstance(env_section["allow_internet"], bool):
            raise TaskFormatError(f"{where}: [environment] allow_internet must be true or false")
        asks.append(env_section["allow_internet"])
    if not asks and compose is not None and compose.network is not None:
        asks.append(compose.network)
    return any(asks)


def _cpus(env_section: dict[str, Any], compose: ComposeService | None, where: Path) -> float | None:
    value = env_section.get("cpus", compose.cpus if compose else None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise TaskFormatError(f"{where}: [environment] cpus must be a positive number, got {value!r}")
    return float(value)


def _container_plan(task_dir: Path, env_section: dict[str, Any]
                    ) -> tuple[DockerPlan | None, ComposeService | None, Path | None, list[str]]:
    """The image recipe: the Dockerfile (of the compose service's build, if there is one), the compose
    service, the build context, and the reasons the local sandbox cannot reproduce it."""
    reasons: list[str] = []
    image = env_section.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise TaskFormatError(f"{task_dir / 'task.toml'}: [environment] docker_image must be an image name "
                              f"such as \"python:3.12-slim\", got {image!r}")
    if image:
        reasons.append(f"it names its own image ({image})")
    env_dir = task_dir / "environment"
    compose = None
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        if (env_dir / name).is_file():
            compose = read_compose((env_dir / name).read_text(encoding="utf-8"), f"environment/{name}")
            reasons += compose.reasons
            if compose.image and not image:
                reasons.append(f"its compose service runs the image {compose.image}")
            break
    gpus = env_section.get("gpus", 0)
    if isinstance(gpus, int) and gpus > 0:
        reasons.append(f"it asks for {gpus} GPU(s)")
    context = env_dir
    dockerfile_name = "Dockerfile"
    if compose is not None and compose.context is not None:
        context = (env_dir / compose.context)
        dockerfile_name = compose.dockerfile
        if not context.resolve().is_relative_to(task_dir.resolve()):
            raise TaskFormatError(f"{env_dir}: the compose build context {compose.context!r} leaves the task "
                                  "folder; keep the build context inside environment/")
    dockerfile_path = context / dockerfile_name
    plan = None
    if dockerfile_path.is_file():
        plan = plan_dockerfile(dockerfile_path.read_text(encoding="utf-8"))
        reasons += plan.reasons
    return plan, compose, (context if context.is_dir() else None), reasons


def _workdir(env_section: dict[str, Any], compose: ComposeService | None, plan: DockerPlan | None,
             where: Path) -> str | None:
    """The default cwd: [environment] workdir, else the compose service's working_dir, else WORKDIR."""
    value = env_section.get("workdir") or (compose.working_dir if compose else None) or (plan.workdir if plan else None)
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise TaskFormatError(f"{where}: the working directory must be an absolute path such as \"/app\", "
                              f"got {value!r}")
    return posixpath.normpath(value)


def _python_base(image: str | None) -> bool:
    """A python:* base image (Docker Hub's, or a mirror of it such as Terminal-Bench's python bases)."""
    repo = (image or "").split("@")[0].split(":")[0].rsplit("/", 1)[-1]
    return repo == "python" or repo.startswith("python-")


def python_base_version(image: str | None) -> str | None:
    """The Python a python:* base image names, as "3.13" (python:3.13-slim, t-bench's python-3-13:...);
    None when it names none (python:3, python:latest) or is not a python image."""
    ref = (image or "").split("@")[0]
    repo, _, tag = ref.rsplit("/", 1)[-1].partition(":")
    found = re.fullmatch(r"python-(\d+)-(\d+)", repo) or (repo == "python" and re.match(r"(\d+)\.(\d+)", tag))
    return f"{found.group(1)}.{found.group(2)}" if found else None


@functools.lru_cache(maxsize=1)
def host_python_version() -> str | None:
    """The local sandbox's python3 (this host's, on the sandbox's PATH), as "3.11"."""
    exe = shutil.which("python3", path=HOST_PATH)
    if exe is None:
        return None
    out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or None


def python_version_reason(image: str | None) -> str | None:
    """Why the local sandbox cannot stand in for a python:X.Y image: its python3 is another version, and
    the version shows (Python 3.12 made float sum() exact, 3.13 changed error messages: a task's expected
    output can hold either)."""
    want, have = python_base_version(image), host_python_version()
    if want and have and want != have:
        return f"its base image {image} is Python {want}; the local sandbox's python3 is {have}"
    return None


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
    plan, compose, context, reasons = _container_plan(task_dir, env_section)
    workdir = _workdir(env_section, compose, plan, toml_path)
    files = image_files(task_dir, plan, toml_path, context, workdir) if context else {}
    if workdir is not None and workdir.strip("/").split("/")[0] in SYSTEM_TOPS:
        reasons.append(f"its working directory {workdir} is in a system folder (read-only in the local sandbox)")
    split = data.get("split", meta.get("split"))
    if split is not None and not isinstance(split, str):
        raise TaskFormatError(f"{toml_path}: split must be a string such as \"train\", got {split!r}")
    env = {**(plan.env if plan else {}), **(compose.env if compose else {}),
           **_str_map(env_section, "environment", toml_path)}
    version_reason = python_version_reason(plan.image) if plan is not None else None
    if version_reason:
        reasons.append(version_reason)
    if plan is not None and not reasons and _python_base(plan.image) and not shutil.which("python", path=HOST_PATH):
        files[PYTHON_SHIM] = BASE_BIN / "python"  # python:* images have `python`; this host has only python3
        env["PATH"] = env.get("PATH", BASE_ENV["PATH"]) + ":" + posixpath.dirname(PYTHON_SHIM)
    return HarborTask(
        name=task_dir.name, path=task_dir, instruction=instruction,
        difficulty=str(meta.get("difficulty", "unknown")), category=str(meta.get("category", "")),
        tags=_tags(meta, task_section, toml_path), split=split,
        agent_timeout_s=_timeout(agent, "agent", toml_path),
        verifier_timeout_s=_timeout(verifier, "verifier", toml_path),
        memory_mb=_memory_mb(env_section, toml_path), docker_image=env_section.get("docker_image") or None,
        workdir=workdir, env=env, network=_network(data, env_section, compose, toml_path),
        cpus=_cpus(env_section, compose, toml_path), compose=compose,
        build_context=context, dockerfile=(compose.dockerfile if compose and compose.context else "Dockerfile")
        if plan else None, setup=tuple(plan.steps) if plan else (), workdirs=tuple(plan.workdirs) if plan else (),
        verifier_env=_str_map(verifier, "verifier", toml_path),
        solution_env=_str_map(_table(data, "solution", toml_path), "solution", toml_path),
        files=files, container_reasons=tuple(dict.fromkeys(reasons)),
        workdir_override=_workdir(env_section, None, None, toml_path),  # [environment] workdir alone
        environment_env=_str_map(env_section, "environment", toml_path))


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
