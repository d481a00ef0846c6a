"""The agent-computer interface harness (SWE-agent style): tools shaped for editing a repository.

The model calls, in its family's tool-call format, ``view`` (a file with line numbers, a window at a
time, or a folder's entries), ``search`` (a string in one file or under a folder), ``edit`` (replace a
line range), ``replace`` (replace one exact occurrence of a text), ``create``, ``run_tests`` (pytest),
``bash`` and ``submit``. Edits of Python files are checked to still compile; a broken edit is refused
and leaves the file unchanged, so the model sees the error rather than a corrupt file. ``submit`` ends
the episode (the environment's verifier then scores the work: for swe, the ``git diff``).

Every command runs through the environment's ``bash`` tool (``aci_runtime``'s source is sent with each
call), so the interface works with any environment that has one -- swe, terminal-bench -- and the
environment stays the one place that touches the sandbox. TITO as in the chat-tools harness.
"""

from __future__ import annotations

import base64
import json
import logging
import shlex
from pathlib import Path
from typing import Any

from miles_agent.environment import EnvSession, Task, ToolError
from miles_agent.harnesses.chat_tools import ChatToolsHarness, ToolCall
from miles_agent.types import Trajectory

log = logging.getLogger(__name__)
RUNTIME = (Path(__file__).with_name("aci_runtime.py")).read_text()
INSTRUCTIONS = ("You fix code in a repository with these tools. Look before you edit: view files and search; "
                "edit by line range or by replacing an exact text; run the tests; call submit when done.")


def _tool(name: str, description: str, properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


_S, _I = {"type": "string"}, {"type": "integer"}
TOOLS = [
    _tool("view", "Show a file with line numbers (100 lines from start), or list a folder",
          {"path": _S, "start": _I, "end": _I}, ("path",)),
    _tool("search", "Find a string in a file or under a folder (default: the repository)", {"pattern": _S, "path": _S},
          ("pattern",)),
    _tool("edit", "Replace lines start..end (inclusive) of a file with content; end=start-1 inserts",
          {"path": _S, "start": _I, "end": _I, "content": _S}, ("path", "start", "end", "content")),
    _tool("replace", "Replace the one occurrence of old with new in a file", {"path": _S, "old": _S, "new": _S},
          ("path", "old", "new")),
    _tool("create", "Create a new file", {"path": _S, "content": _S}, ("path", "content")),
    _tool("run_tests", "Run pytest (optionally on given test files or node ids)", {"args": _S}),
    _tool("bash", "Run a shell command", {"command": _S}, ("command",)),
    _tool("submit", "Finish: your changes are the answer", {}),
]
RUNTIME_OPS = {"view", "search", "edit", "replace", "create"}


def runtime_command(name: str, arguments: dict[str, Any]) -> str:
    """The shell command that runs an ACI call in the sandbox."""
    if name == "run_tests":
        args = arguments.get("args", "")
        if not isinstance(args, str):
            raise ToolError('run_tests takes {"args": "tests/test_x.py"} (a string) or nothing')
        return f"python3 -m pytest -q -p no:cacheprovider {args}".rstrip()
    payload = base64.b64encode(json.dumps({"op": name, **arguments}).encode()).decode()
    return f"python3 -c {shlex.quote(RUNTIME)} {payload}"


class ACIHarness(ChatToolsHarness):
    name = "aci"
    description = "Agent-computer interface for coding: view/search/edit (lint-checked)/run_tests/submit over bash."
    system_instructions = INSTRUCTIONS
    _warned = False

    def prompt_tools(self, session: EnvSession) -> list[dict[str, Any]] | None:
        return TOOLS

    def parse_actions(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls, errors = super().parse_actions(text)
        if any(c.name == "submit" for c in calls):
            return [], []  # the episode ends here, as when the model answers without a call
        return calls, errors

    async def run(self, task: Task, session: EnvSession, policy: Any) -> list[Trajectory]:
        if not any(t.get("function", {}).get("name") == "bash" for t in session.tools) and not self._warned:
            self._warned = True  # every call will then be an error the model sees; the episode still runs
            log.warning("the aci harness runs its commands through the environment's bash tool, and this "
                        "environment has none; use it with swe or terminal-bench")
        return await super().run(task, session, policy)

    async def _call(self, session: EnvSession, call: ToolCall, traj: Trajectory) -> str:
        known = {t["function"]["name"] for t in TOOLS}
        if call.name not in known:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(sorted(known))}"
        if call.name != "bash":
            try:
                call = ToolCall("bash", {"command": runtime_command(call.name, call.arguments)}, call.id)
            except ToolError as e:
                return f"error: {e}"
        return await super()._call(session, call, traj)
