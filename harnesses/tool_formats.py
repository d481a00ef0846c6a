"""Tool-call formats of the model families the recipes name, besides Qwen / Hermes (the core's).

Each is the ``miles_agent.families`` entry point of one family and reads what that family's chat template
writes for an assistant tool call (docs/recipes.md shows each form):

* DeepSeek-V3: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a fenced json block + ``<｜tool▁call▁end｜>``;
* Kimi-K2: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>``;
* GLM-4.5: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs (V is JSON unless
  it is a string) and ``</tool_call>``;
* gpt-oss (harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}``, ended by
  the ``<|call|>`` stop token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles_agent.tool_calls import ToolCallBlock, ToolCallFormat, json_arguments


def _call(match: re.Match[str], name: str, args_text: str, call_id: str | None = None) -> ToolCallBlock:
    args = json_arguments(args_text)
    if isinstance(args, str):
        return ToolCallBlock(match.start(), match.end(), error=args, id=call_id)
    return ToolCallBlock(match.start(), match.end(), name, args, id=call_id)


class DeepSeekV3Format(ToolCallFormat):
    description = "DeepSeek-V3: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME + a ```json block"
    name = "deepseek-v3"
    model_types = ("deepseek_v3",)
    opener, closer = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    example = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    BLOCK = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    INNER = re.compile(r"(\w+)<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*\Z", re.DOTALL)

    def scan(self, text: str) -> list[ToolCallBlock]:
        out = []
        for m in self.BLOCK.finditer(text):
            inner = self.INNER.match(m.group(1))
            out.append(_call(m, inner.group(2).strip(), inner.group(3)) if inner else ToolCallBlock(
                m.start(), m.end(), error="needs function<｜tool▁sep｜>NAME and a ```json block"))
        return out


class KimiK2Format(ToolCallFormat):
    description = "Kimi-K2: <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}"
    name = "kimi-k2"
    model_types = ("kimi_k2",)
    opener, closer = "<|tool_call_begin|>", "<|tool_call_end|>"
    example = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}"
               "<|tool_call_end|><|tool_calls_section_end|>")
    BLOCK = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)"
                       r"<\|tool_call_end\|>", re.DOTALL)
    CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[\w.\-]+?):\d+\Z")

    def scan(self, text: str) -> list[ToolCallBlock]:
        out = []
        for m in self.BLOCK.finditer(text):
            call_id = m.group("id")
            named = self.CALL_ID.match(call_id)
            out.append(_call(m, named.group("name"), m.group("args"), call_id) if named else ToolCallBlock(
                m.start(), m.end(), error=f"call id {call_id!r} is not functions.NAME:INDEX", id=call_id))
        return out


class Glm45Format(ToolCallFormat):
    description = "GLM-4.5: <tool_call>NAME with <arg_key>/<arg_value> pairs"
    name = "glm-4.5"
    model_types = ("glm4_moe", "glm4")
    example = "<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"
    stop_tokens = ("<|user|>", "<|observation|>")  # GLM has no end-of-turn token: the next role's ends a turn
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def scan(self, text: str) -> list[ToolCallBlock]:
        out = []
        for m in self.BLOCK.finditer(text):
            body = m.group(1)
            name = body.split("<arg_key>", 1)[0].strip()
            if not name or not re.fullmatch(r"[\w.\-]+", name):
                out.append(ToolCallBlock(m.start(), m.end(), error="needs the function name right after <tool_call>"))
                continue
            args: dict[str, Any] = {}
            for key, value in self.PAIR.findall(body):
                try:  # the template writes non-strings as JSON and strings bare
                    args[key.strip()] = json.loads(value)
                except ValueError:
                    args[key.strip()] = value
            out.append(ToolCallBlock(m.start(), m.end(), name, args))
        return out

    def assistant_message(self, text: str) -> dict[str, Any]:
        """GLM's template rebuilds a call from ``tool_calls`` (it strips the content), so the message
        carries them structured."""
        return structured_message(text, self.scan(text))


class HarmonyFormat(ToolCallFormat):
    """gpt-oss: channels (analysis, commentary, final) in one turn; a call is a commentary message addressed
    to ``functions.NAME``, ended by ``<|call|>`` (a stop token, so the harness's text never holds it)."""

    description = "gpt-oss (harmony): a commentary message to=functions.NAME, ended by <|call|>"
    name = "gpt-oss"
    model_types = ("gpt_oss",)
    opener, closer = "<|message|>", "<|call|>"
    example = "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"
    stop_tokens = ("<|call|>", "<|return|>")
    SEGMENT = re.compile(r"(?:<\|start\|>assistant)?(?P<head>[^<]*?)<\|channel\|>(?P<channel>\w+)(?P<to>[^<]*)"
                         r"(?:<\|constrain\|>\s*\w+)?<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)",
                         re.DOTALL)
    RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")

    def scan(self, text: str) -> list[ToolCallBlock]:
        out = []
        for m in self.SEGMENT.finditer(text):
            to = self.RECIPIENT.search(m.group("head") + m.group("to"))
            if to:
                out.append(_call(m, to.group(1), m.group("body")))
        return out

    def unterminated(self, text: str) -> bool:
        return False  # the <|call|> stop token ends a call; a cut-off one fails as JSON

    def assistant_message(self, text: str) -> dict[str, Any]:
        thinking, final = [], []
        for m in self.SEGMENT.finditer(text):
            if not self.RECIPIENT.search(m.group("head") + m.group("to")):
                (final if m.group("channel") == "final" else thinking).append(m.group("body"))
        message: dict[str, Any] = {"role": "assistant", "content": "".join(final)}
        calls = tool_calls(self.scan(text))
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["thinking"] = "".join(thinking)
        return message


def tool_calls(blocks: list[ToolCallBlock]) -> list[dict[str, Any]]:
    """The parsed calls as an OpenAI-style ``tool_calls`` list (arguments as objects, as templates read them)."""
    return [{"type": "function", **({"id": b.id} if b.id else {}), "function": {"name": b.name, "arguments": b.arguments}}
            for b in blocks if b.ok]


def structured_message(text: str, blocks: list[ToolCallBlock]) -> dict[str, Any]:
    """An assistant message with the parsed calls as ``tool_calls`` and the rest of ``text`` as content."""
    kept, cursor = [], 0
    for b in blocks:
        if b.ok:
            kept.append(text[cursor:b.start])
            cursor = b.end
    message: dict[str, Any] = {"role": "assistant", "content": ("".join(kept) + text[cursor:]).strip()}
    calls = tool_calls(blocks)
    if calls:
        message["tool_calls"] = calls
    return message
