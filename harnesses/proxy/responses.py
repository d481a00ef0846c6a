"""OpenAI response bodies and server-sent-event chunks for a recorded `Turn`.

The rollout-engine contract returns whole completions (as SGLang's ``/generate`` does without
streaming), so a streamed response is the finished turn sent as SSE chunks in OpenAI's order: the role,
content pieces, each tool call (id and name, then its arguments), the finish reason, an optional usage
chunk, then ``[DONE]``. Clients that accumulate chunks rebuild exactly the non-streamed message.

Logprob entries carry one extra field, ``token_id``, so a token-aware client can see the exact ids.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from miles_agent.harnesses.proxy.history import Turn

_PIECE = 16  # characters per streamed content chunk


def usage(turn: Turn) -> dict[str, int]:
    n = len(turn.completion.output_ids)
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n, "total_tokens": turn.prompt_tokens + n}


def chat_completion(turn: Turn, model: str, logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content, "refusal": None}
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    choice = {"index": 0, "message": message, "finish_reason": turn.finish_reason,
              "logprobs": _chat_logprobs(turn, tokenizer) if logprobs else None}
    return {"id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(turn)}


def chat_chunks(turn: Turn, model: str, logprobs: bool, include_usage: bool, tokenizer: Any) -> Iterator[bytes]:
    base = {"id": _id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> bytes:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]})

    yield chunk({"role": "assistant", "content": ""}, lp=_chat_logprobs(turn, tokenizer) if logprobs else None)
    for piece in _pieces(turn.content or ""):
        yield chunk({"content": piece})
    for i, call in enumerate(turn.tool_calls):
        fn = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in _pieces(fn["arguments"]):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, turn.finish_reason)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": usage(turn)})
    yield b"data: [DONE]\n\n"


def text_completion(turn: Turn, model: str, logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": turn.text, "finish_reason": _text_finish(turn),
              "logprobs": _text_logprobs(turn, tokenizer) if logprobs else None}
    return {"id": _id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(turn)}


def text_chunks(turn: Turn, model: str, logprobs: bool, include_usage: bool, tokenizer: Any) -> Iterator[bytes]:
    base = {"id": _id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model}
    pieces = list(_pieces(turn.text)) or [""]
    for k, piece in enumerate(pieces):
        lp = _text_logprobs(turn, tokenizer) if logprobs and k == 0 else None
        yield _sse({**base, "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": lp}]})
    yield _sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": _text_finish(turn), "logprobs": None}]})
    if include_usage:
        yield _sse({**base, "choices": [], "usage": usage(turn)})
    yield b"data: [DONE]\n\n"


def _chat_logprobs(turn: Turn, tokenizer: Any) -> dict[str, Any]:
    c = turn.completion
    content = [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": [], "token_id": t}
               for t, lp in zip(c.output_ids, c.output_logprobs)]
    return {"content": content, "refusal": None}


def _text_logprobs(turn: Turn, tokenizer: Any) -> dict[str, Any]:
    c = turn.completion
    tokens = [tokenizer.decode([t]) for t in c.output_ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": list(c.output_logprobs), "top_logprobs": None,
            "text_offset": offsets, "token_ids": list(c.output_ids)}


def _text_finish(turn: Turn) -> str:
    return "length" if turn.finish_reason == "length" else "stop"


def _pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), _PIECE):
        yield text[i:i + _PIECE]


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
