"""Images for the docker sandbox: a task's build context built once per content, or a named image made present.

Builds. A `ImageBuild` (a Harbor task's environment/ and its Dockerfile) is built through the engine's build
endpoint and tagged ``miles-agent-build:<hash>``, where the hash covers every file of the context (path, exec
bit, bytes), the Dockerfile's path, the build args and the ids of the images it starts from (FROM, COPY --from):
an unchanged task on unchanged bases reuses its image; an edit, or a base image replaced or updated, rebuilds.
Builds of one hash are serialised in this process, and a build that failed is remembered, so the episode
retries that follow fail at once with the same message instead of rebuilding. A failed build is a
`ImageBuildError` naming the failing step of the task's Dockerfile and the tail of the build log.

Named images are used when present and pulled only when missing; a pull that cannot reach a registry is an
`ImageUnavailableError` that says how to provide the image offline (load or tag it).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_agent.sandbox import ImageBuild, SandboxError

BUILD_REPO = "miles-agent-build"
BUILD_LABEL = "miles-agent.build"
LOG_TAIL_LINES = 25
_STEP = re.compile(r"^\s*(?:Step \d+/\d+ :|STEP \d+/\d+:|#\d+ \[[^\]]+\])\s*(.*)$")

_locks: dict[str, threading.Lock] = {}
_failed: dict[str, str] = {}  # tag -> the message of its failed build (this process)
_locks_guard = threading.Lock()


class ImageBuildError(SandboxError):
    """The task's image could not be built: its Dockerfile failed at a step (named in the message)."""


class ImageUnavailableError(SandboxError):
    """A named image is neither present on the engine nor pullable from here."""


def context_hash(build: ImageBuild) -> str:
    """A digest of everything the build reads: the context's files (path, exec bit, content), the
    Dockerfile's path inside it and the build args."""
    root = Path(build.context)
    if not root.is_dir():
        raise ImageBuildError(f"docker sandbox: build context {root} is not a folder; point the task's "
                              "environment at a folder holding its Dockerfile")
    digest = hashlib.sha256()
    digest.update(f"dockerfile={build.dockerfile}\n".encode())
    for key in sorted(build.build_args):
        digest.update(f"arg {key}={build.build_args[key]}\n".encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                digest.update(f"link {rel} -> {os.readlink(path)}\n".encode())
                continue
            mode = path.stat().st_mode
            digest.update(f"file {rel} {'x' if mode & 0o111 else '-'} {path.stat().st_size}\n".encode())
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE)
_COPY_FROM = re.compile(r"^\s*(?:COPY|ADD)\s.*--from=(\S+)", re.IGNORECASE)


def base_images(dockerfile: Path) -> list[str]:
    """The images a Dockerfile starts from or copies out of: FROM and COPY --from names that are not one of
    its own stages (nor `scratch`), in order. Names holding ${ARG}s are left out: they are resolved at build."""
    stages: set[str] = set()
    images: list[str] = []
    for line in dockerfile.read_text(errors="replace").splitlines():
        if m := _FROM.match(line):
            name, alias = m.group(1), m.group(2)
            if name.lower() not in stages and name != "scratch" and "$" not in name:
                images.append(name)
            if alias:
                stages.add(alias.lower())
        elif (m := _COPY_FROM.match(line)) and m.group(1).lower() not in stages and not m.group(1).isdigit():
            images.append(m.group(1))
    return images


def build_tag(build: ImageBuild, base_ids: tuple[str, ...] = ()) -> str:
    digest = hashlib.sha256(context_hash(build).encode())
    for base in base_ids:
        digest.update(f"base {base}\n".encode())
    return f"{BUILD_REPO}:{digest.hexdigest()[:24]}"


def _base_ids(api: Any, build: ImageBuild) -> tuple[str, ...]:
    dockerfile = Path(build.context) / build.dockerfile
    if not dockerfile.is_file():
        return ()
    return tuple(f"{name}={(image_exists(api, name) or {}).get('Id', 'absent')}" for name in base_images(dockerfile))


def _lock(tag: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(tag, threading.Lock())


def image_exists(api: Any, image: str) -> dict | None:
    """The engine's inspect of ``image``, or None when it does not have it."""
    import docker

    try:
        return api.inspect_image(image)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.NotFound:
        return None


def ensure_built(api: Any, build: ImageBuild, client: Callable[[float], Any], *, timeout_s: float) -> str:
    """The tag of ``build``'s image, built now unless the engine already has it (see the module doc)."""
    tag = build_tag(build, _base_ids(api, build))
    with _lock(tag):
        if tag in _failed:
            raise ImageBuildError(_failed[tag])
        if image_exists(api, tag) is not None:
            return tag
        try:
            _build(api, build, tag, client(timeout_s))
        except ImageBuildError as e:
            _failed[tag] = str(e)
            raise
        return tag


def _build(api: Any, build: ImageBuild, tag: str, client: Any) -> None:
    """Build with ``client`` (one whose timeout fits a build); ``api`` checks the result."""
    import docker

    dockerfile = Path(build.context) / build.dockerfile
    if not dockerfile.is_file():
        raise ImageBuildError(f"docker sandbox: {dockerfile} is missing; the task's environment needs a Dockerfile")
    log: list[str] = []
    step = None
    try:
        stream = client.build(path=str(build.context), dockerfile=build.dockerfile, tag=tag,
                              buildargs=dict(build.build_args) or None, rm=True, forcerm=True, decode=True,
                              labels={BUILD_LABEL: tag.partition(":")[2]})
        for event in stream:
            text = event.get("stream") or event.get("status") or ""
            for line in text.splitlines():
                if line.strip():
                    log.append(line.rstrip())
                    if m := _STEP.match(line):
                        step = m.group(1).strip()
            if "error" in event or "errorDetail" in event:
                detail = event.get("error") or (event.get("errorDetail") or {}).get("message", "")
                raise ImageBuildError(_failure(dockerfile, step, detail, log))
    except docker.errors.BuildError as e:
        raise ImageBuildError(_failure(dockerfile, step, str(e), log)) from e
    except docker.errors.APIError as e:
        raise ImageBuildError(_failure(dockerfile, step, str(e), log)) from e
    if image_exists(api, tag) is None:
        raise ImageBuildError(_failure(dockerfile, step, "the engine reported no error but has no image", log))


def _failure(dockerfile: Path, step: str | None, detail: str, log: list[str]) -> str:
    where = f"at step `{step[:200]}`" if step else "before its first step"
    tail = "\n".join(log[-LOG_TAIL_LINES:])
    hint = ""
    if re.search(r"pip[0-9.]* install|uv (pip|add|sync)|npm (i|install)|go (get|mod)|cargo", step or "") \
            and re.search(r"(?i)resolv|connect|network|temporary failure|name or service|offline", tail + detail):
        hint = (" The step fetches packages from a registry this machine cannot reach: build the image where it "
                "can and load it here (docker/podman load), or vendor the packages into the build context.")
    return (f"docker sandbox: building {dockerfile} failed {where}: {detail.strip()[:500]}.{hint}\n"
            f"build log (last {LOG_TAIL_LINES} lines):\n{tail}")


def ensure_image(api: Any, image: str, client: Callable[[float], Any], *, timeout_s: float) -> dict:
    """``image``'s inspect, pulling it first only when the engine does not have it."""
    import docker

    found = image_exists(api, image)
    if found is not None:
        return found
    repo, tag = _split(image)
    puller = client(timeout_s)
    try:
        for event in puller.pull(repo, tag=tag, stream=True, decode=True):
            if "error" in event:
                raise docker.errors.APIError(event["error"])
    except docker.errors.APIError as e:
        code = getattr(getattr(e, "response", None), "status_code", None)
        if code in (429, 502, 503, 504) or "toomanyrequests" in str(e).lower():
            raise  # a rate limit or a passing fault: the caller retries
        raise ImageUnavailableError(
            f"docker sandbox: image {image} is not on the engine and pulling it failed ({str(e)[:300]}); "
            f"without a reachable registry provide it offline: `docker load -i IMAGE.tar` (or `podman load`), "
            f"or tag an image you have with that name (`docker tag LOCAL {image}`)") from e
    found = image_exists(api, image)
    if found is None:
        raise ImageUnavailableError(f"docker sandbox: pulled {image} but the engine does not list it")
    return found


def _split(image: str) -> tuple[str, str]:
    """(repository, tag) as the pull endpoint wants them; a digest stays in the repository."""
    if "@" in image:
        return image, ""
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:  # no tag, or the colon was a registry port
        return image, "latest"
    return repo, tag


def image_workdir(inspect: dict) -> str | None:
    """The image's own WORKDIR; None when it sets none or "/" (what a `commit` leaves): the root is no
    place to work, and the sandbox's /workspace is used instead."""
    workdir = (inspect.get("Config") or {}).get("WorkingDir") or ""
    return None if workdir.rstrip("/") == "" else workdir
