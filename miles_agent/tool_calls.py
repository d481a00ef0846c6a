"""Tool calls in model text, in the format of the model's family; Qwen / Hermes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` is the built-in one.

The harnesses (which run the tools), the OpenAI-compatible proxy (which turns a sampled turn into an
assistant message with ``tool_calls``) and the adapters all read model text through a `ToolCallFormat`, so a
block is a call in one place exactly when it is a call in the others. ``arguments`` may be an object or a
JSON string holding one (some models write the latter). Other families (DeepSeek-V3, Kimi-K2, GLM-4.5,
gpt-oss) are plug-ins of the ``miles_agent.families`` group (harnesses/tool_formats.py), chosen from the model's config.json
``model_type`` or by ``model.family``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallBlock:
    """One tool-call block: where it sits in the text, and its call -- or why it is not one."""

    start: int
    end: int
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None  # set exactly when the block does not parse into a call
    id: str | None = None  # the call id the format writes (Kimi-K2's functions.NAME:INDEX), if any

    @property
    def ok(self) -> bool:
        return self.error is None


def json_arguments(text: str) -> dict[str, Any] | str:
    """A call's arguments from JSON text (an object, or a string holding one), or why they are not."""
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError as e:
        return f"arguments are not JSON ({e})"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            return f"arguments is a string that is not JSON ({e})"
    return args if isinstance(args, dict) else '"arguments" must be an object'


class ToolCallFormat:
    """Qwen / Hermes: ``<tool_call>{json}</tool_call>``, any number per turn. A family subclasses it."""

    name = "qwen3"
    model_types: tuple[str, ...] = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
    opener, closer = "<tool_call>", "</tool_call>"
    example = '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    stop_tokens: tuple[str, ...] = ()  # besides EOS and <|im_end|>: what else ends a turn

    def scan(self, text: str) -> list[ToolCallBlock]:
        """Every closed block in ``text``, in order, parsed or with the reason it does not parse."""
        return [_parse_json_block(m.group(1), m.start(), m.end()) for m in TOOL_CALL_BLOCK.finditer(text)]

    def unterminated(self, text: str) -> bool:
        """Whether a block was opened and never closed (a turn cut off, or a typo)."""
        return text.count(self.opener) != text.count(self.closer)

    def assistant_message(self, text: str) -> dict[str, Any]:
        """The chat message a sampled turn stands for; re-rendered, it must give back ``text``. Templates
        that write content verbatim take the text as is (exact whatever the model wrote)."""
        return {"role": "assistant", "content": text}


QWEN = ToolCallFormat()


def scan_tool_calls(text: str) -> list[ToolCallBlock]:
    return QWEN.scan(text)


def unterminated(text: str) -> bool:
    return QWEN.unterminated(text)


def tool_format(tokenizer: Any) -> ToolCallFormat:
    """The format a run's tokenizer carries (models/loading.py sets it), else Qwen's."""
    return getattr(tokenizer, "tool_call_format", None) or QWEN


def choose_format(family: str, model_config: Any = None) -> ToolCallFormat:
    """``model.family`` by name, or (``auto``) the family whose ``model_types`` has the config's model_type;
    a model no family claims gets the Qwen / Hermes form."""
    from miles_agent import registry

    if family != "auto":
        return QWEN if family in ("qwen3", "hermes") else registry.load("families", family, key="model.family")()
    model_type = getattr(model_config, "model_type", None) or ""
    for name in registry.names("families"):
        cls = registry.load("families", name)
        if model_type in getattr(cls, "model_types", ()):
            return cls()
    return QWEN


def _parse_json_block(block: str, start: int, end: int) -> ToolCallBlock:
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

