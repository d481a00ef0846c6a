"""The terminal harness, Terminus-style: the model writes shell commands in ``<bash>...</bash>`` blocks,
the sandbox runs them (through the environment's ``bash`` tool), and the output comes back as the next
user turn. The episode ends when the model replies without a command (it considers the task done),
or a turn/token limit ends it.

Same TITO machinery as the chat-tools harness: only the action format and the observation role differ,
so the model needs no native tool-calling support.
"""

from __future__ import annotations

import re
from typing import Any

from miles_agent.environment import EnvSession
from miles_agent.harnesses.chat_tools import ChatToolsHarness, ToolCall

_BASH = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)

INSTRUCTIONS = ("You are in a Linux shell in the task's working directory. Run a command by writing "
                "<bash>COMMAND</bash>; its output comes back in the next message. When the task is done, "
                "reply without a command.")


class TerminalHarness(ChatToolsHarness):
    name = "terminal"
    description = "Terminus-style shell loop: <bash>cmd</bash> blocks run in the sandbox; output is the next turn."
    system_instructions = INSTRUCTIONS

    def prompt_tools(self, session: EnvSession) -> list[dict[str, Any]] | None:
        return None  # the action format is the <bash> block, explained in the system message

    def parse_actions(self, text: str) -> tuple[list[ToolCall], list[str]]:
        commands = [c.strip() for c in _BASH.findall(text)]
        errors = []
        if text.count("<bash>") != text.count("</bash>"):
            errors.append("error: unterminated <bash> block; close it with </bash>")
        if any(not c for c in commands):
            errors.append("error: empty <bash></bash> block; put a shell command inside")
        return [ToolCall("bash", {"command": c}) for c in commands if c], errors

    def observation_messages(self, calls: list[ToolCall], results: list[str]) -> list[dict[str, Any]]:
        parts = []
        for i, result in enumerate(results):
            if i < len(calls):
                parts.append(f"$ {calls[i].arguments['command']}\n{result}")
            else:
                parts.append(result)
        return [{"role": "user", "content": "\n".join(parts)}]
