"""Launching and supervising servers, router registration, ``--sglang-*`` flags, and the config plug-in."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
from pathlib import Path

import pytest
from conftest import FAKE
from fake_router import FakeRouter

from miles_agent.components import cluster_for
from miles_agent.config import load_config
from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.engines.sglang.server import server_argv
from miles_agent.errors import UserError
from miles_agent.models.builder import build_tiny
from miles_agent.server_flags import split_sglang_flags, with_server_args


def test_sglang_flags_pass_through_verbatim():
    argv = ["train", "--env", "arith-tools", "--sglang-tp-size", "2", "--sglang-enable-torch-compile",
            "--sglang-mem-fraction-static=0.7", "--sglang-attention-backend", "fa3", "rollout.engine=sglang",
            "--sglang-disable-radix-cache", "run.steps=2"]
    rest, flags = split_sglang_flags(argv)
    assert rest == ["train", "--env", "arith-tools", "rollout.engine=sglang", "run.steps=2"]
    assert flags == {"tp_size": 2, "enable_torch_compile": True, "mem_fraction_static": 0.7,
                     "attention_backend": "fa3", "disable_radix_cache": True}
    cfg = with_server_args(load_config("tiny-cpu", ["sglang.server_args={tp_size: 1, log_level: info}"]), flags)
    assert cfg.sglang.server_args["tp_size"] == 2 and cfg.sglang.server_args["log_level"] == "info"
    assert server_argv("python -m sglang.launch_server", "/m", "127.0.0.1", 30000, cfg.sglang.server_args) == [
        "python", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30000",
        "--tp-size", "2", "--log-level", "info", "--enable-torch-compile", "--mem-fraction-static", "0.7",
        "--attention-backend", "fa3", "--disable-radix-cache"]
    with pytest.raises(UserError, match="set by miles-agent"):
        server_argv("x", "/m", "h", 1, {"port": 5})
    with pytest.raises(UserError, match="external_urls must be a list"):
        load_config("tiny-cpu", ["sglang.external_urls=http://a:1"])


ARGV_SERVER = Path(__file__).with_name("argv_server.py")


def test_launcher_supervises_and_registers_with_the_router(tmp_path):
    """Fast: stand-in servers that start in a blink (the slow test below runs the model-backed fake)."""
    model, tok = build_tiny("tiny-qwen3")
    router = FakeRouter()
    cfg = load_config("tiny-cpu", [
        "rollout.engine=sglang", "sglang.num_servers=2", f"sglang.router_url={router.url}", "sglang.tp_size=2",
        f"sglang.launch_command={shlex.quote(sys.executable)} {shlex.quote(str(ARGV_SERVER))}",
        f"model.hf_checkpoint={tmp_path}/ckpt", "sglang.server_args={enable_torch_compile: true}",
        f"run.run_dir={tmp_path}"])
    engines = cluster_for(cfg).engines(model, tok)

    async def main():
        try:
            for e in engines:
                argv = (await e._get("/get_server_info"))["argv"]
                assert argv == ["--model-path", f"{tmp_path}/ckpt", "--host", "127.0.0.1", "--port",
                                e.url.rsplit(":", 1)[1], "--enable-torch-compile", "--tp-size", "2"]
                assert e.generate_urls == [router.url]
            assert router.workers == [e.url for e in engines]
            victim = engines[0]
            os.killpg(victim.process._proc.pid, signal.SIGKILL)
            await asyncio.to_thread(victim.process._proc.wait)
            assert not await victim.health()
            assert await asyncio.to_thread(victim.process.ensure_running, 60)
            assert victim.process.restarts == 1 and await victim.health()
            assert not await asyncio.to_thread(victim.process.ensure_running, 60)  # alive: nothing to do
        finally:
            for e in engines:
                await e.shutdown()
    try:
        asyncio.run(main())
    finally:
        router.close()
    assert all(not e.process.alive() for e in engines)
    assert router.workers == [] and [k for k, _ in router.events] == ["add", "add", "remove", "remove"]


@pytest.mark.slow
def test_launch_register_supervise_and_shut_down(tmp_path):
    """The model-backed fake, launched: arguments, generation through the router, restart, shutdown."""
    model, tok = build_tiny("tiny-qwen3")
    router = FakeRouter()
    _, flags = split_sglang_flags(["--sglang-tp-size", "2"])
    cfg = with_server_args(load_config("tiny-cpu", [
        "rollout.engine=sglang", "sglang.num_servers=2", f"sglang.router_url={router.url}",
        f"sglang.launch_command={shlex.quote(sys.executable)} {shlex.quote(str(FAKE))}",
        "sglang.mem_fraction_static=0.5", "sglang.server_args={enable_torch_compile: true}", f"run.run_dir={tmp_path}"]),
        flags)
    engines = cluster_for(cfg).engines(model, tok)

    async def main():
        try:
            infos = [await e._get("/get_server_info") for e in engines]
            for info in infos:  # every argument reached the server's command line
                assert info["tp_size"] == "2" and info["mem_fraction_static"] == "0.5"
                assert info["enable_torch_compile"] is True
                assert info["model_path"] == str((tmp_path / "sglang" / "initial_model").resolve())
            assert router.workers == [e.url for e in engines]
            outs = await asyncio.gather(*(engines[0].generate([1, 2, 3], SamplingParams(max_new_tokens=4))
                                          for _ in range(4)))
            assert all(o.finish_reason is not FinishReason.ABORT and o.output_ids for o in outs)
            assert sorted(router.forwarded.values()) == [2, 2]  # generation went through the router to both

            victim = engines[1]
            os.killpg(victim.process._proc.pid, signal.SIGKILL)
            await asyncio.to_thread(victim.process._proc.wait)
            assert not await victim.health()
            assert await asyncio.to_thread(victim.process.ensure_running, 120)
            assert victim.process.restarts == 1 and await victim.health()
        finally:
            for e in engines:
                await e.shutdown()
    try:
        asyncio.run(main())
    finally:
        router.close()
    assert all(not e.process.alive() for e in engines)
    assert router.workers == [] and [k for k, _ in router.events] == ["add", "add", "remove", "remove"]


def test_launch_failure_names_the_log(tmp_path):
    model, tok = build_tiny("tiny-qwen3")
    cfg = load_config("tiny-cpu", ["rollout.engine=sglang", f"run.run_dir={tmp_path}",
                                   f"sglang.launch_command={shlex.quote(sys.executable)} -c 'import sys; "
                                   "print(\"no GPU here\"); sys.exit(3)'"])
    with pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*no GPU here"):
        cluster_for(cfg).engines(model, tok)
