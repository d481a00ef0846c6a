"""The desktop's tools (mouse and keyboard as the model calls them) and its observation as text.

Coordinates are screen pixels, origin top-left, the same in the screenshot and in the accessibility
tree (which gives each element's centre), so a text-only policy and a vision policy act alike.
"""

from __future__ import annotations

import re
from typing import Any

from miles_agent.environment import ToolError

from .desktop import Observation

KEYS = re.compile(r"^[A-Za-z0-9_+\-]+( [A-Za-z0-9_+\-]+)*$")  # xdotool keysyms: "ctrl+s", "Return", "ctrl+a BackSpace"
MAX_TEXT = 2000
_XY = {"x": {"type": "integer", "description": "screen x in pixels"},
       "y": {"type": "integer", "description": "screen y in pixels"}}


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = [
    _tool("click", "Click at a screen position.", {**_XY, "button": {"type": "string", "enum": ["left", "middle", "right"]}},
          ["x", "y"]),
    _tool("double_click", "Double-click at a screen position.", dict(_XY), ["x", "y"]),
    _tool("type", "Type text with the keyboard into the focused element.", {"text": {"type": "string"}}, ["text"]),
    _tool("key", "Press a key or combination, e.g. 'Return', 'ctrl+s', 'Tab'; several separated by spaces.",
          {"keys": {"type": "string"}}, ["keys"]),
    _tool("scroll", "Scroll at a screen position.", {**_XY, "direction": {"type": "string", "enum": [
        "up", "down", "left", "right"]}, "amount": {"type": "integer", "description": "wheel clicks, 1-20"}},
          ["x", "y", "direction"]),
    _tool("drag", "Press the left button at (x, y), move to (x2, y2), release.",
          {**_XY, "x2": {"type": "integer"}, "y2": {"type": "integer"}}, ["x", "y", "x2", "y2"]),
    _tool("wait", "Wait for the screen to settle.", {"seconds": {"type": "number", "description": "0-10"}}, []),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


def _int(args: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = args.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
        raise ToolError(f"{key} must be an integer, got {value!r}")
    if not lo <= int(value) <= hi:
        raise ToolError(f"{key}={int(value)} is off the screen ({lo}..{hi})")
    return int(value)


def parse_action(name: str, args: dict[str, Any], width: int, height: int) -> dict[str, Any]:
    """A tool call as the guest's action dict; `ToolError` (shown to the model) for a bad call."""
    if name not in TOOL_NAMES:
        raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    action: dict[str, Any] = {"action": name}
    if name in ("click", "double_click", "scroll", "drag"):
        action.update(x=_int(args, "x", 0, width - 1), y=_int(args, "y", 0, height - 1))
    if name == "click":
        button = args.get("button", "left")
        if button not in ("left", "middle", "right"):
            raise ToolError(f"button must be left, middle or right, not {button!r}")
        action["button"] = button
    elif name == "type":
        text = args.get("text")
        if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
            raise ToolError(f"text must be a non-empty string of at most {MAX_TEXT} characters")
        action["text"] = text
    elif name == "key":
        keys = args.get("keys")
        if not isinstance(keys, str) or not KEYS.match(keys.strip()):
            raise ToolError(f"keys {keys!r}: give key names like 'Return' or 'ctrl+s', separated by spaces")
        action["keys"] = keys.strip()
    elif name == "scroll":
        direction = args.get("direction", "down")
        if direction not in ("up", "down", "left", "right"):
            raise ToolError(f"direction must be up, down, left or right, not {direction!r}")
        action.update(direction=direction, amount=_int({"amount": args.get("amount", 3)}, "amount", 1, 20))
    elif name == "drag":
        action.update(x2=_int(args, "x2", 0, width - 1), y2=_int(args, "y2", 0, height - 1))
    elif name == "wait":
        seconds = args.get("seconds", 1.0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 10:
            raise ToolError(f"seconds must be a number from 0 to 10, not {seconds!r}")
        action["seconds"] = float(seconds)
    return action


def centre(node: dict[str, Any]) -> tuple[int, int]:
    return node["x"] + node["w"] // 2, node["y"] + node["h"] // 2


def a11y_text(obs: Observation, width: int, height: int, max_nodes: int = 80) -> str:
    """The observation a text-only policy reads: the windows, then the browser's accessibility tree."""
    lines = [f"Screen {width}x{height}."]
    for w in obs.windows:
        focus = " (focused)" if w.get("focused") else ""
        lines.append(f'Window "{w["name"]}" at ({w["x"]},{w["y"]}) size {w["w"]}x{w["h"]}{focus}')
    if obs.a11y:
        lines.append("Accessibility tree (role \"name\" at centre x,y):")
        base = min(n["depth"] for n in obs.a11y)
        for n in obs.a11y[:max_nodes]:
            x, y = centre(n)
            extra = "".join(f" {k}={n[k]!r}" for k in ("value", "checked", "focused", "disabled") if k in n)
            lines.append(f'{"  " * min(n["depth"] - base, 6)}{n["role"]} "{n["name"]}" at ({x},{y}){extra}')
        if len(obs.a11y) > max_nodes:
            lines.append(f"... {len(obs.a11y) - max_nodes} more elements")
    lines.extend(obs.notes)
    return "\n".join(lines)


def find_target(obs: Observation, target: dict[str, Any]) -> tuple[int, int]:
    """The centre of the element (or window) a scripted oracle names: {"role", "name"} or {"window"}."""
    if "window" in target:
        for w in obs.windows:
            if target["window"] in w["name"]:
                return w["x"] + w["w"] // 2, w["y"] + w["h"] // 2
        raise LookupError(f"no window named like {target['window']!r}: {[w['name'] for w in obs.windows]}")
    for n in obs.a11y:
        if n["role"] == target.get("role", n["role"]) and n["name"] == target["name"]:
            return centre(n)
    raise LookupError(f"no element {target} in the accessibility tree: "
                      f"{[(n['role'], n['name']) for n in obs.a11y]}")
