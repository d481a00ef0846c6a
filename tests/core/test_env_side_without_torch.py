"""The env side (contracts, envs/, harnesses/, sandboxes/) imports and runs without torch, so environment
workers can live on CPU-only nodes or under another Python."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import asyncio
import miles_agent.types, miles_agent.engine, miles_agent.environment, miles_agent.sandbox, miles_agent.registry
from miles_agent.envs.arith_tools import ArithToolsEnv
from miles_agent.envs.terminal_bench import TerminalBenchEnv
from miles_agent.harnesses.chat_tools import ChatToolsHarness
from miles_agent.harnesses.terminal import TerminalHarness
from miles_agent.sandboxes.local import LocalSandbox
from miles_agent.algorithms.advantages import grpo
from miles_agent.environment import HarnessLimits
from miles_agent.engine import SamplingParams
from miles_agent.models.tokenizer import build_byte_tokenizer

tok = build_byte_tokenizer()
env = ArithToolsEnv()
task = env.tasks()[0]
harness = ChatToolsHarness(tok, HarnessLimits(), SamplingParams())
async def main():
    session = await env.open(task)
    return await harness.run(task, session, env.oracle_policy(tok))
(traj,) = asyncio.run(main())
traj.validate()
assert traj.reward == 1.0, traj.reward
assert "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
print("ok")
"""


def test_env_side_runs_without_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
