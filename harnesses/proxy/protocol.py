"""The OpenAI wire format: request validation into typed requests, and OpenAI-shaped errors.

Validation is strict where a silent default would change what is trained on (``n``, penalties,
``top_logprobs``) and lenient about fields that do not affect sampling (``user``, ``metadata``,
``parallel_tool_calls``): agent frameworks send many of those, and rejecting them would break agents
for no gain. Every rejection names the field and what to send instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class ProxyError(Exception):
    """An error returned to the client as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", retry: bool = True) -> None:  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry = retry  # False sets ``x-should-retry: false`` so the openai SDK does not retry

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ClientSampling:
    """What the client asked for; the server decides how much of it to honour (see ProxyServer)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # normalized: text content, OpenAI-shaped tool_calls
    tools: list[dict[str, Any]] | None
    sampling: ClientSampling
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    parse_tools: bool = True  # False when tool_choice is "none"
    model: str = ""


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: ClientSampling
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str = ""


def parse_chat_request(body: Any) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", "messages")
    tools = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none", "required") and not isinstance(tool_choice, dict):
        raise bad_request(f"tool_choice {tool_choice!r} is not valid; use 'auto', 'none', 'required' or "
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad_request("'logprobs' must be true or false", "logprobs")
    if body.get("top_logprobs"):
        raise bad_request("top_logprobs is not supported: the engine returns the sampled token's logprob "
                          "only; send logprobs=true without top_logprobs", "top_logprobs")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("response_format other than {'type': 'text'} is not supported (no constrained "
                          "decoding); ask for the format in the prompt instead", "response_format")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stream, include_usage = _stream(body)
    return ChatRequest(
        messages=[normalize_message(m, i) for i, m in enumerate(messages)], tools=tools,
        sampling=_sampling(body, max_tokens, "max_completion_tokens" if "max_completion_tokens" in body
                           else "max_tokens"),
        stream=stream, include_usage=include_usage, logprobs=logprobs,
        parse_tools=tool_choice != "none", model=_model(body))


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad_request("'prompt' must be a string or one list of non-negative token ids; batches of "
                              "several prompts are not supported (send one request each)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")
    for name, unset in (("suffix", (None, "")), ("echo", (None, False)), ("best_of", (None, 1))):
        if body.get(name) not in unset:
            raise bad_request(f"'{name}' is not supported by this proxy; leave it out", name)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise bad_request("'logprobs' must be a non-negative integer for completions", "logprobs")
    stream, include_usage = _stream(body)
    return CompletionRequest(prompt=prompt, sampling=_sampling(body, body.get("max_tokens"), "max_tokens"),
                             stream=stream, include_usage=include_usage, logprobs=logprobs is not None,
                             model=_model(body))


def normalize_message(m: Any, index: int) -> dict[str, Any]:
    """A message as the chat template reads it: text content, OpenAI-shaped tool calls, roles checked."""
    where = f"messages[{index}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role is {role!r}; use one of {', '.join(ROLES)}", f"{where}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _text(m.get("content"), f"{where}.content")}
    if out["content"] is None and role != "assistant":
        raise bad_request(f"{where} ({role}) has no content", f"{where}.content")
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    elif role == "tool":
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
        if m.get("name") is not None:
            out["name"] = str(m["name"])
    return out


def message_key(m: dict[str, Any]) -> tuple:
    """What must be equal for a resent message to be the same turn (ids and JSON spacing do not matter)."""
    calls = tuple((c["function"]["name"], _canonical_json(c["function"]["arguments"]))
                  for c in m.get("tool_calls") or ())
    return m["role"], m.get("content") or "", calls


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def _canonical_json(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (TypeError, ValueError):
        return arguments


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}[{k}] is a {kind!r} part; only text parts are supported "
                                  '({"type": "text", "text": ...})', where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string, a list of text parts, or null", where)


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": str(c.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., "
                              "'parameters': {...}}}", f"tools[{k}]")
    return tools


def _sampling(body: dict[str, Any], max_tokens: Any, max_name: str) -> ClientSampling:
    if body.get("n", 1) not in (1, None):
        raise bad_request(f"n={body['n']} is not supported: one request samples one completion; send n "
                          "requests instead (each extends the session's history)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by the rollout engine; leave it out or send 0", name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by the rollout engine; leave it out", "logit_bias")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise bad_request(f"'{max_name}' must be a positive integer, got {max_tokens!r}", max_name)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k == 0 or top_k < -1):
        raise bad_request("'top_k' must be -1 (off) or a positive integer", "top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request("'seed' must be an integer", "seed")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    return ClientSampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed, stop=tuple(stop or ()))


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return stream, bool(opts.get("include_usage")) and stream


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad_request(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    return model


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body
