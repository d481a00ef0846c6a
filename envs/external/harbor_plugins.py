"""Harbor plug-ins loaded by ``import_path`` inside the Harbor venv (this file imports harbor).

`LocalEnvironment`: a Harbor environment provider for machines without a container runtime. Each
trial gets its own root folder; every ``exec`` is a bubblewrap process whose ``/`` is that folder,
with the host's ``/usr`` and ``/etc`` mounted read-only on top and no network, so the task's absolute
paths (``/app``, ``/tests``, ``/logs/verifier``) land in the trial's folder. It honours tasks whose
image is the host's userland (a Dockerfile that only copies files); it does not build images.

`ProxyShellAgent`: a Harbor agent that asks an OpenAI-compatible endpoint (our proxy) for shell
commands, runs each in the environment and shows the output back, for a few turns.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.agent.context import AgentContext


class LocalEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "miles-local"

    def _validate_definition(self):
        return None

    def _path(self, target: str) -> Path:
        return self._root / target.lstrip("/")

    async def start(self, force_build: bool) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="harbor-local-"))
        for d in ("tmp", "root", "app", "logs/agent", "logs/verifier", "logs/artifacts", "usr", "etc", "proc", "dev"):
            self._path(d).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):  # as on merged-/usr hosts; made once, not per exec
            os.symlink(f"usr/{link}", self._path(link))
        if self.environment_dir.is_dir():  # the files a file-only Dockerfile copies in
            await self.upload_dir(self.environment_dir, "/app")
            for name in ("Dockerfile", ".dockerignore"):
                self._path(f"/app/{name}").unlink(missing_ok=True)

    async def stop(self, delete: bool):
        if delete and getattr(self, "_root", None):
            shutil.rmtree(self._root, ignore_errors=True)

    async def upload_file(self, source_path, target_path: str):
        dest = self._path(target_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, dest)

    async def upload_dir(self, source_dir, target_dir: str):
        shutil.copytree(source_dir, self._path(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path):
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._path(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir):
        shutil.copytree(self._path(source_dir), target_dir, dirs_exist_ok=True)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        argv = ["bwrap", "--bind", str(self._root), "/", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc",
                "--proc", "/proc", "--dev", "/dev", "--unshare-net",
                "--unshare-pid", "--die-with-parent", "--chdir", cwd or "/app", "bash", "-c", command]
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


SYSTEM = ("You are in a Linux shell. Reply with exactly one shell command to run, or DONE when the "
          "task is finished.")


class ProxyShellAgent(BaseAgent):
    @staticmethod
    def name() -> str:
        return "miles-proxy-shell"

    def version(self) -> str | None:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        from openai import AsyncOpenAI

        env = self._extra_env  # the trial's agent env: this episode's proxy session
        client = AsyncOpenAI(base_url=env["MILES_PROXY_BASE_URL"], api_key=env["MILES_PROXY_API_KEY"], max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": instruction}]
        for _ in range(int(env.get("MILES_PROXY_MAX_TURNS", "3"))):
            reply = await client.chat.completions.create(model=self.model_name or "policy", messages=messages,
                                                         max_tokens=64)
            command = (reply.choices[0].message.content or "").strip()
            messages.append({"role": "assistant", "content": command})
            if not command or command == "DONE":
                break
            result = await environment.exec(command, timeout_sec=30)
            messages.append({"role": "user", "content": f"exit {result.return_code}\n{result.stdout}{result.stderr}"})
