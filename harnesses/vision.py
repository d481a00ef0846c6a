"""Screenshots as image inputs of a vision-language policy, for the chat/tool-call harness.

When the policy's tokenizer names an image placeholder id (``tokenizer.image_placeholder_id``, set for a
vision-language model by `miles_agent.models.builder`) and the session keeps screenshots (the desktop env's
``DesktopSession.screenshots``), the opening user turn and every tool-result turn carry the screen as an image
content part. The chat template renders one ``<|image_pad|>`` per image; `expand` widens each to the image's
placeholder count and records the `ImageInput`s, so the ids are encoded once and never re-split. A text-only
policy on the same env sees the same turns without the images (the accessibility tree's text).
"""

from __future__ import annotations

from typing import Any

from miles_agent.environment import EnvSession


def image_id(tokenizer: Any) -> int | None:
    tid = getattr(tokenizer, "image_placeholder_id", None)
    return None if tid is None else int(tid)


def screens(session: EnvSession) -> int:
    return len(getattr(session, "screenshots", None) or ())


def latest_screen(session: EnvSession, after: int) -> bytes | None:
    """The newest screenshot, if the session took one since it had ``after``."""
    shots = getattr(session, "screenshots", None) or ()
    return shots[-1] if len(shots) > after else None


def with_image(content: Any, png: bytes) -> list[dict[str, Any]]:
    """``content`` (a string or parts) led by an image part holding ``png``."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    return [{"type": "image", "png": png}, *parts]


async def attach_opening(messages: list[dict[str, Any]], session: EnvSession, image: bool) -> None:
    """The screen before the first action on the last user message of the opening: its text (a session's
    ``opening_text()``, the desktop's windows and accessibility tree) and, with ``image``, its screenshot."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return
    msg = messages[users[-1]]
    opening = getattr(session, "opening_text", None)
    if opening is not None and isinstance(msg["content"], str):
        msg = {**msg, "content": msg["content"] + "\n\n" + await opening()}
    png = latest_screen(session, 0) if image else None
    messages[users[-1]] = msg if png is None else {**msg, "content": with_image(msg["content"], png)}


def attach_result(tool_msgs: list[dict[str, Any]], session: EnvSession, before: int) -> None:
    """The screen after this turn's actions, on the turn's last tool message (if an action took one)."""
    png = latest_screen(session, before)
    if png is not None and tool_msgs:
        tool_msgs[-1] = {**tool_msgs[-1], "content": with_image(tool_msgs[-1]["content"], png)}


def pngs_of(messages: list[dict[str, Any]]) -> list[bytes]:
    return [p["png"] for m in messages if not isinstance(m.get("content"), str | None)
            for p in m["content"] if p.get("type") == "image"]


def expand(ids: list[int], messages: list[dict[str, Any]], token_id: int, offset: int = 0) -> tuple[list[int], list]:
    """The render ``ids`` of ``messages`` with each image's placeholder widened, and their `ImageInput`s."""
    from miles_agent.models.vision import expand_images

    pngs = pngs_of(messages)
    if not pngs:
        return ids, []
    return expand_images(ids, token_id, pngs, offset)
