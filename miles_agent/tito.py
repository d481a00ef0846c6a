"""Token-in-token-out chat bookkeeping: render the first prompt once, then only ever tokenize new suffixes.

Known failure modes this guards against (see shared/DESIGN.md):

* re-tokenizing history drifts at turn boundaries -> we never re-tokenize: the model's turns are the
  ids it sampled, and only the template's delta for new messages is tokenized;
* rendering one message at a time differs from rendering the conversation (consecutive tool results
  share one turn) -> the delta is taken over the whole conversation;
* the template re-renders the end-of-turn token the engine already sampled -> we compute what the
  template writes after an assistant message's content and drop the part that was sampled;
* templates that are not append-only (stripped ``<think>``, rewritten history) -> the prefix check
  fails loudly with `NotAppendOnly`, and the harness starts a new branch.
"""

from __future__ import annotations

from typing import Any

from miles_agent.types import ImageInput, TrajectoryError

_SENTINEL = "\u2063MILES_SENTINEL\u2063"


class NotAppendOnly(Exception):
    """The chat template rendered an earlier part of the conversation differently after new messages."""


def with_chat_options(tokenizer: Any, template_kwargs: dict[str, Any], tool_call_format: Any = None) -> Any:
    """The run's tokenizer carries ``model.chat_template_kwargs`` (e.g. ``enable_thinking: false``) and the
    family's tool-call format, so every render and parse of it -- harness, proxy, SFT data -- uses them: it is
    the object every renderer and harness is given."""
    tokenizer.chat_template_kwargs = dict(template_kwargs)
    if tool_call_format is not None:
        tokenizer.tool_call_format = tool_call_format
    return tokenizer


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    return dict(getattr(tokenizer, "chat_template_kwargs", None) or {})  # a bare HF tokenizer has none


class ChatRenderer:
    """Renders with the tokenizer's own chat template; tokenizes only what is new."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = template_kwargs(tokenizer)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first prompt: the only full render that is ever tokenized."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, history: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                        sampled_stop_text: str, sampled_text: str | None = None) -> list[int]:
        """Ids to append after the model's last turn so the token history equals a full render.

        ``history`` ends with the assistant message whose content is the decoded sampled text without
        its stop token; ``sampled_stop_text`` is that stop token's text ("" if the turn was cut by a
        length limit, in which case the template's end-of-turn marker is appended as observation).
        ``sampled_text``: the turn's text as sampled, when the message is structured (``tool_calls``) rather
        than that text as content; what follows it in the render is the template's end of turn.
        """
        if not history or history[-1].get("role") != "assistant":
            raise ValueError("history must end with the assistant turn the model just sampled")
        before = self.render(history, add_generation_prompt=False)
        after = self.render(history + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise NotAppendOnly(_first_difference(before, after))
        tail = self._after_assistant_content(history) if sampled_text is None else _after(before, sampled_text)
        delta = after[len(before):]
        if sampled_stop_text and tail.startswith(sampled_stop_text):
            tail = tail[len(sampled_stop_text):]
        elif sampled_stop_text and not tail and delta.startswith(sampled_stop_text):
            delta = delta[len(sampled_stop_text):]  # no end-of-turn token (GLM): the next role's tag stopped it
        return self.encode(tail + delta)

    def _after_assistant_content(self, history: list[dict[str, Any]]) -> str:
        """What the template writes after the last assistant message's content (e.g. '<|im_end|>\\n')."""
        probe = history[:-1] + [{**history[-1], "content": _SENTINEL}]
        text = self.render(probe, add_generation_prompt=False)
        idx = text.rfind(_SENTINEL)
        if idx < 0:
            raise NotAppendOnly("the chat template does not render assistant content verbatim")
        return text[idx + len(_SENTINEL):]


def image_inputs(ids: list[int], token_id: int, pngs: list[bytes], offset: int = 0) -> list[ImageInput]:
    """The runs of ``token_id`` in ``ids`` (a render whose image pads the processor already expanded), one per
    PNG in order, as `ImageInput`s at ``offset`` + their position: the ids are kept as encoded, never re-split."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token_id:
            j = i
            while j < len(ids) and ids[j] == token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    if len(runs) != len(pngs):
        raise TrajectoryError(f"{len(runs)} image placeholder runs in the ids for {len(pngs)} images")
    return [ImageInput(offset + a, offset + b, token_id, png) for (a, b), png in zip(runs, pngs)]


def _after(before: str, sampled_text: str) -> str:
    idx = before.rfind(sampled_text)
    if idx < 0:
        raise NotAppendOnly("the chat template renders the model's turn differently from the text it sampled")
    return before[idx + len(sampled_text):]


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"the template re-rendered history differently at character {i}: {a[i:i + 40]!r} became {b[i:i + 40]!r}"
