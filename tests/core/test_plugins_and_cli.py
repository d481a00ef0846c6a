"""Plug-ins by entry point, and the CLI's promise: bad input -> one clear line, exit 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_agent import registry
from miles_agent.errors import UserError

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "thirdparty_env"


def cli(*args: str, env: dict[str, str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_agent.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)


@pytest.fixture(scope="module")
def thirdparty(tmp_path_factory) -> dict[str, str]:
    """Install the fixture package (a separate distribution) into a private folder; return its env."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(FIXTURE)], check=True, capture_output=True, timeout=240)
    return {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}


def test_builtin_plugins_are_listed():
    names = {p.name: p for p in registry.list_plugins("envs")}
    assert names["arith-tools"].package == "miles-agent" and names["arith-tools"].error is None
    assert "calculator" in names["arith-tools"].description
    assert {p.name for p in registry.list_plugins("trainers")} >= {"fsdp2"}
    with pytest.raises(UserError, match="unknown environment 'nope'; installed: .*arith-tools"):
        registry.load("envs", "nope")
    with pytest.raises(UserError, match="cannot load environment 'no.such:Thing'"):
        registry.load("envs", "no.such:Thing")
    assert registry.load("envs", "miles_agent.envs.arith_tools:ArithToolsEnv").name == "arith-tools"


def test_backends_are_plugins_listed_by_the_cli():
    for kind, expected in (("engines", {"embedded", "sglang"}), ("transports", {"inprocess", "shm", "distributed", "disk"}),
                           ("clusters", {"inprocess", "ray"})):
        plugins = registry.list_plugins(kind)
        assert {p.name for p in plugins} >= expected and all(p.error is None for p in plugins), plugins
    out = cli("engines", "list")
    assert out.returncode == 0 and "embedded" in out.stdout and "in-process engine" in out.stdout, out
    assert "object-store" not in cli("transports", "list").stdout  # Ray's own, chosen by the runtime
    with pytest.raises(UserError, match=r"unknown rollout engine 'vllm' \(rollout.engine=vllm\); installed: embedded"):
        registry.load("engines", "vllm", key="rollout.engine")


def test_thirdparty_env_is_listed_and_a_broken_one_does_not_hide_it(thirdparty):
    out = cli("envs", "list", env=thirdparty)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert "[miles-echo-env]" in lines["echo-letters"] and "Third-party fixture" in lines["echo-letters"]
    assert "BROKEN: ModuleNotFoundError" in lines["broken-env"]
    assert "arith-tools" in lines


def test_thirdparty_env_trains(thirdparty, tmp_path):
    out = cli("train", "--env", "echo-letters", "--run-dir", str(tmp_path), "--steps", "2", "--no-progress",
              "model.warm_start=null", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
              "env.max_new_tokens_per_turn=8", env=thirdparty)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "final" / "config.json").is_file()


@pytest.mark.parametrize("args, cause", [
    (["train", "--env", "nosuch"], "unknown environment 'nosuch'"),
    (["train", "--env", "arith-tools", "--recipe", "{bad}"], "unknown recipe"),
    (["train", "--env", "arith-tools", "--hf-checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt does not exist"),
    (["train", "--env", "arith-tools", "model.device=cuda"], "no CUDA GPU is visible"),
    (["train", "--env", "arith-tools", "train.lr=fast"], "must be a number"),
    (["eval", "--env", "arith-tools", "--policy", "psychic"], "unknown --policy"),
])
def test_bad_input_gives_one_clear_line(args, cause, tmp_path):
    out = cli(*args, "--run-dir", str(tmp_path)) if args[0] == "train" else cli(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and cause in lines[0] and lines[0].startswith("miles-agent: error:"), out.stderr


def test_malformed_recipe_file(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("train: {lr: [1,\n")
    out = cli("train", "--env", "arith-tools", "--recipe", str(bad))
    assert out.returncode == 2 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr


def test_eval_oracle_on_a_folder_of_harbor_tasks(tmp_path):
    import shutil

    shipped = REPO / "envs" / "terminal_bench" / "tasks"
    for name in ("hello-file", "csv-column-sum"):
        shutil.copytree(shipped / name, tmp_path / name)
    out = cli("eval", "--env", "terminal-bench", "--policy", "oracle", "--tasks", str(tmp_path), "--split", "all")
    assert out.returncode == 0, out.stderr
    assert "reward 1.000 over 2 episodes" in out.stdout


def test_sandbox_exec_reports_output_exit_code_and_limits():
    out = cli("sandbox", "exec", "--timeout", "1", "--", "bash", "-c", "echo out; echo err >&2; sleep 5")
    assert out.returncode == 124, out.stderr  # timed out (see test_cli_sandbox_exec.py)
    assert "out\n" in out.stdout and "err\n" in out.stdout and "limit hit: wall_time" in out.stdout
    out = cli("sandbox", "exec", "--", "cat /root/.bash_history /etc/shadow; exit 7")
    assert "exit code 7" in out.stdout and "No such file" in out.stdout
