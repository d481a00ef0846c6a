"""Turning a sampled turn's text into an OpenAI assistant message: content plus ``tool_calls``.

The model writes Qwen-style blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of them in one turn (parallel tool calls). A block that parses becomes a ``tool_calls`` entry and
leaves the content; a malformed one stays in the content verbatim, so the agent sees what the model wrote
and the session's history is unchanged either way (the token history always holds the sampled ids).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the parsed blocks, or None when nothing but tool calls is left; OpenAI tool_calls)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    cursor = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1))
        if call is None:
            continue
        kept.append(text[cursor:match.start()])
        cursor = match.end()
        calls.append(call)
    if not calls:
        return text, []
    content = ("".join(kept) + text[cursor:]).strip()
    return content or None, calls


def _parse_block(block: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
