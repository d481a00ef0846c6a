"""Harbor plug-ins loaded by ``import_path`` inside the Harbor venv (this file imports harbor).

`LocalEnvironment`: a Harbor environment provider for machines without a container runtime. Each
trial gets its own root folder; every ``exec`` is a bubblewrap process whose ``/`` is that folder,
with the host's ``/usr`` and ``/etc`` mounted read-only on top and no network, so the task's absolute
paths (``/app``, ``/tests``, ``/logs/verifier``) land in the trial's folder. It honours tasks whose
image is the host's userland (a Dockerfile that only copies files); it does not build images.

Symlinks. The trial root is the agent's filesystem, and the host side reads and writes it (Harbor
uploads tests/ after the agent acted, downloads logs): a link the agent made there (``/tests -> /etc``)
would be followed on the host, as root when miles-agent runs as root. So every host-side path into the
trial root is resolved and refused if it leaves the root (`_inside`), files are written over a link
rather than through it, and downloads leave links out. Uploads come from the task folder, which is
downloaded and untrusted too: a link in it that leaves the folder is refused (`_refuse_links_out`).

Identity. Every exec runs in a user namespace as uid 0 *inside*; when miles-agent runs as root, bwrap
itself first drops to an unprivileged host uid of the trial's own (``setpriv``), which owns the trial
root, so root in the trial is never the host's root (a writable /proc/sys, root's keys). /proc/sys is
bound read-only on top all the same.

`ProxyShellAgent`: a Harbor agent that asks an OpenAI-compatible endpoint (our proxy) for shell
commands, runs each in the environment and shows the output back, for a few turns; it declares
Harbor's ``skills`` capability and names the skills Harbor copied in.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import shutil
import tempfile
from pathlib import Path

from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.agent.context import AgentContext

SANDBOX_UID_BASE = 1_700_000_000  # as the local sandbox's (sandboxes/_local_identity.py): no real user's


class LocalEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "miles-local"

    def _validate_definition(self):
        return None

    def _path(self, target: str) -> Path:
        return self._root / target.lstrip("/")

    def _inside(self, target: str) -> Path:
        """The host path of ``target`` with the folders above it resolved, refused if a link leads out of
        the trial root. The last component is kept as is: a writer replaces a link there, never follows it."""
        path = self._path(target)
        parent = Path(os.path.realpath(path.parent))
        if not parent.is_relative_to(os.path.realpath(self._root)):
            raise PermissionError(f"{target} leads out of the sandbox through a symlink (to {parent})")
        return parent / path.name

    def _write_file(self, source: Path, target: str) -> None:
        dest = self._inside(target)
        self._mkdirs(dest.parent)
        if dest.is_symlink():
            dest.unlink()  # a link the agent left there: replace it, do not write through it
        shutil.copy2(source, dest)
        self._own(dest)

    def _mkdirs(self, path: Path) -> None:
        missing = []
        while not path.exists() and path != self._root:
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            d.mkdir()
            self._own(d)

    def _own(self, path: Path) -> None:
        """Give what the host wrote to the trial's uid (a root caller's files would be unwritable inside)."""
        if self._uid is not None:
            os.lchown(path, self._uid, self._uid)

    async def start(self, force_build: bool) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="harbor-local-"))
        self._uid = SANDBOX_UID_BASE + secrets.randbelow(1 << 20) if os.geteuid() == 0 else None
        for d in ("tmp", "root", "app", "logs/agent", "logs/verifier", "logs/artifacts", "usr", "etc", "proc", "dev"):
            self._mkdirs(self._path(d))
        for link in ("bin", "lib", "lib64", "sbin"):  # as on merged-/usr hosts; made once, not per exec
            os.symlink(f"usr/{link}", self._path(link))
            self._own(self._path(link))
        self._own(self._root)
        if self.environment_dir.is_dir():  # the files a file-only Dockerfile copies in
            await self.upload_dir(self.environment_dir, "/app")
            for name in ("Dockerfile", ".dockerignore"):
                self._path(f"/app/{name}").unlink(missing_ok=True)

    async def stop(self, delete: bool):
        if delete and getattr(self, "_root", None):
            shutil.rmtree(self._root, ignore_errors=True)

    async def upload_file(self, source_path, target_path: str):
        source = Path(source_path)
        _refuse_links_out(source, source.parent)
        self._write_file(source, target_path)

    async def upload_dir(self, source_dir, target_dir: str):
        source = Path(source_dir)
        _refuse_links_out(source, source)
        self._copy_tree(source.resolve(), target_dir, (source.resolve(),))

    def _copy_tree(self, real_dir: Path, target: str, ancestors: tuple[Path, ...]) -> None:
        """Copy a checked folder in; its links (all inside it) are copied as what they point to."""
        dest = self._inside(target)
        if dest.is_symlink():
            dest.unlink()  # a link the agent left where the folder goes
        self._mkdirs(dest)
        for entry in sorted(os.scandir(real_dir), key=lambda e: e.name):
            src, sub = Path(entry.path).resolve(), f"{target.rstrip('/')}/{entry.name}"
            if src.is_dir():
                if src in ancestors:
                    raise PermissionError(f"{entry.path} links back to its own folder (a loop)")
                self._copy_tree(src, sub, (*ancestors, src))
            elif src.is_file():
                self._write_file(src, sub)

    async def download_file(self, source_path: str, target_path):
        source = self._inside(source_path)
        if source.is_symlink():
            raise PermissionError(f"{source_path} is a symlink in the sandbox; not following it on the host")
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target_path)

    async def download_dir(self, source_dir: str, target_dir):
        source = self._inside(source_dir)
        if source.is_symlink():
            raise PermissionError(f"{source_dir} is a symlink in the sandbox; not following it on the host")
        shutil.copytree(source, target_dir, dirs_exist_ok=True, ignore=_links)  # a link would be followed later

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        drop = [] if self._uid is None else ["setpriv", f"--reuid={self._uid}", f"--regid={self._uid}",
                                             "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
        argv = [*drop, "bwrap", "--unshare-user", "--uid", "0", "--gid", "0", "--bind", str(self._root), "/",
                "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--proc", "/proc",
                "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev", "--unshare-net", "--unshare-pid",
                "--unshare-ipc", "--die-with-parent", "--chdir", cwd or "/app", "bash", "-c", command]
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(*argv, env={**base, **(env or {})},
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            return ExecResult(stdout=out.decode(errors="replace"), stderr="timed out", return_code=124)
        return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                          return_code=proc.returncode)


def _links(folder: str, names: list[str]) -> list[str]:
    """copytree's ignore: the entries of ``folder`` that are symlinks."""
    return [n for n in names if os.path.islink(os.path.join(folder, n))]


def _refuse_links_out(path: Path, folder: Path) -> None:
    """Raise if ``path`` (a file, or a folder walked without following links) holds a symlink whose target
    is outside ``folder``: the task folder is downloaded, and its links must not copy host files in."""
    boundary = os.path.realpath(folder)
    links = [path] if path.is_symlink() else []
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path):
            links += [Path(dirpath, n) for n in dirnames + filenames if Path(dirpath, n).is_symlink()]
    for link in links:
        target = os.path.realpath(link)
        if not (os.path.exists(target) and Path(target).is_relative_to(boundary)):
            raise PermissionError(f"{link} is a symlink to {os.readlink(link)!r} ({target}), outside {boundary}; "
                                  "replace the link with a copy of the file inside the task folder")


SYSTEM = ("You are in a Linux shell. Reply with exactly one shell command to run, or DONE when the "
          "task is finished.")


class ProxyShellAgent(BaseAgent):
    """One shell command per model turn. The reply goes back into the history exactly as the model wrote
    it (only the command run is stripped), so the proxy sees one growing history -- one trajectory per
    episode. No max_tokens unless the adapter passes one: the proxy's per-turn limit applies."""

    capabilities = AgentCapabilities(skills=True)

    @staticmethod
    def name() -> str:
        return "miles-proxy-shell"

    def version(self) -> str | None:
        return "2"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def _skills_note(self, environment: BaseEnvironment) -> str:
        """Harbor copies the task's (or the trial's) skills to ``skills_dir``: name them to the model."""
        if not self.skills_dir:
            return ""
        found = await environment.exec(f"ls -1 {shlex.quote(self.skills_dir)} 2>/dev/null", timeout_sec=30)
        names = [n for n in found.stdout.split() if n]
        if not names:
            return ""
        return (f"\nSkills are available in {self.skills_dir}: {', '.join(names)}. Read one with "
                f"`cat {self.skills_dir}/NAME/SKILL.md` before using it.")

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        from openai import AsyncOpenAI

        env = self._extra_env  # the trial's agent env: this episode's proxy session
        client = AsyncOpenAI(base_url=env["MILES_PROXY_BASE_URL"], api_key=env["MILES_PROXY_API_KEY"], max_retries=0)
        extra = {"max_tokens": int(env["MILES_PROXY_MAX_TOKENS"])} if env.get("MILES_PROXY_MAX_TOKENS") else {}
        system = SYSTEM + await self._skills_note(environment)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": instruction}]
        for _ in range(int(env.get("MILES_PROXY_MAX_TURNS", "3"))):
            reply = await client.chat.completions.create(model=self.model_name or "policy", messages=messages, **extra)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})  # as generated: the proxy's own history
            command = text.strip()
            if not command or command == "DONE":
                break
            result = await environment.exec(command, timeout_sec=30)
            messages.append({"role": "user", "content": f"exit {result.return_code}\n{result.stdout}{result.stderr}"})
