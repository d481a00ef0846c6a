"""The one parser of Qwen-style tool calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The harnesses (which run the tools), the OpenAI-compatible proxy (which turns a sampled turn into an
assistant message with ``tool_calls``) and the adapters all read model text through `scan_tool_calls`,
so a block is a call in one place exactly when it is a call in the others. ``arguments`` may be an
object or a JSON string holding one (some models write the latter).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallBlock:
    """One ``<tool_call>`` block: where it sits in the text, and its call -- or why it is not one."""

    start: int
    end: int
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None  # set exactly when the block does not parse into a call

    @property
    def ok(self) -> bool:
        return self.error is None


def scan_tool_calls(text: str) -> list[ToolCallBlock]:
    """Every closed block in ``text``, in order, parsed or with the reason it does not parse."""
    return [_parse(m.group(1), m.start(), m.end()) for m in TOOL_CALL_BLOCK.finditer(text)]


def unterminated(text: str) -> bool:
    """Whether a ``<tool_call>`` was opened and never closed (a turn cut off, or a typo)."""
    return text.count("<tool_call>") != text.count("</tool_call>")


def _parse(block: str, start: int, end: int) -> ToolCallBlock:
    try:
        obj = json.loads(block)
    except ValueError as e:
        return ToolCallBlock(start, end, error=f"not JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallBlock(start, end, error='needs a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            return ToolCallBlock(start, end, error=f"arguments is a string that is not JSON ({e})")
    if not isinstance(args, dict):
        return ToolCallBlock(start, end, error='"arguments" must be an object')
    return ToolCallBlock(start, end, obj["name"], args)
