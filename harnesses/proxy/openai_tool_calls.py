"""Turning a sampled turn's text into an OpenAI assistant message: content plus ``tool_calls``.

The model writes Qwen-style blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of them in one turn (parallel tool calls). A block that parses becomes a ``tool_calls`` entry and
leaves the content (blocks are read by `miles_agent.tool_calls`); a malformed one stays in the content verbatim, so the agent sees what the model wrote
and the session's history is unchanged either way (the token history always holds the sampled ids).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles_agent.tool_calls import QWEN, ToolCallFormat


def split_tool_calls(text: str, fmt: ToolCallFormat = QWEN) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the parsed blocks, or None when nothing but tool calls is left; OpenAI tool_calls),
    the blocks in the model family's format (the run's tokenizer carries it)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    cursor = 0
    for block in fmt.scan(text):
        if not block.ok:
            continue
        kept.append(text[cursor:block.start])
        cursor = block.end
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.arguments, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = ("".join(kept) + text[cursor:]).strip()
    return content or None, calls
