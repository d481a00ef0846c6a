"""An example HUD environment with a tool (imports hud and fastmcp: it runs only in the HUD venv).

HUD environments give the agent tools as capabilities; the usual one is an MCP server the env starts
in its ``@env.initialize`` hook. Here: a FastMCP server on a free 127.0.0.1 port with one tool,
``count_letter(word, letter)``; the template ``count(word, letter)`` asks how often the letter occurs
and rewards 1.0 for an answer containing the right number. HUD's OpenAI-compatible agent offers the
tool to the model as an OpenAI function tool and runs the calls over MCP.
"""

from __future__ import annotations

import asyncio
import socket

from fastmcp import FastMCP
from hud import Environment
from hud.capabilities import Capability

env = Environment("miles-hud-tools")
tools = FastMCP(name="miles-hud-tools")


@tools.tool()
async def count_letter(word: str, letter: str) -> int:
    """How many times `letter` occurs in `word`."""
    return word.count(letter)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@env.initialize
async def _serve_tools() -> None:
    port = _free_port()
    env._mcp_task = asyncio.ensure_future(tools.run_http_async(host="127.0.0.1", port=port, show_banner=False,
                                                                log_level="warning"))
    for _ in range(100):  # wait until it accepts connections
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.05)
    env.add_capability(Capability.mcp(name="tools", url=f"http://127.0.0.1:{port}/mcp"))


@env.shutdown
async def _stop_tools() -> None:
    env._mcp_task.cancel()


@env.template(id="count", description="Count a letter in a word (a tool can do it); reward 1.0 if right.")
async def count(word: str, letter: str):
    answer = yield f"How many times does '{letter}' occur in '{word}'? Answer with the number."
    yield 1.0 if str(word.count(letter)) in str(answer or "") else 0.0
