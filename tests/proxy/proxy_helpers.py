"""Helpers for the proxy tests: a deterministic fake engine, a recording wrapper, and the TITO oracle.

The oracle rebuilds a branch's token ids from scratch -- one render of the whole conversation by the
chat template, with each sampled assistant turn replaced by the ids the engine returned -- and the
proxy's incrementally built trajectory must equal it exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from miles_agent.engine import Completion, FinishReason, PauseMode, SamplingParams
from miles_agent.types import SpanKind, Trajectory

TOOL_NAMES = ("calc", "search", "write_file", "天气")
UNICODE = ["héllo wörld", "数学很难", "🙂👍🏽", "naïve café", "Ω≈ç√∫", "a\tb", "line\nbreak", "'single' \"double\"",
           "<b>html</b>", "{not json}", "emoji 🧪🔬", "Ελληνικά", "עברית", "‮rtl‬", "trailing space ", ""]


def tool_schema(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


class RecordingPolicy:
    """Wraps a policy and remembers every call: input ids -> completion."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[tuple[int, ...], Completion] = {}

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        c = await self.inner.generate(input_ids, sampling, return_routed_experts=return_routed_experts)
        key = tuple(input_ids)
        assert key not in self.calls or self.calls[key].output_ids == c.output_ids, "one input, two outputs"
        self.calls[key] = c
        return c


class FuzzEngine:
    """A RolloutEngine whose reply is a pure function of the input ids: text with unicode, thinking, and
    0-3 tool calls (sometimes malformed), ending with the stop token or cut by max_new_tokens."""

    def __init__(self, tokenizer: Any, stop_rate: float = 0.85) -> None:
        self.tokenizer = tokenizer
        self.stop_rate = stop_rate
        self.version = 0
        self.paused = False

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, input_ids, sampling: SamplingParams, *, return_routed_experts=False) -> Completion:
        rng = random.Random(hashlib.blake2b(json.dumps(list(input_ids)).encode(), digest_size=8).digest())
        ids = self.tokenizer.encode(reply_text(rng), add_special_tokens=False)
        finish = FinishReason.LENGTH
        if rng.random() < self.stop_rate:
            ids, finish = ids + [self.tokenizer.eos_token_id], FinishReason.STOP
        else:
            ids = ids[:rng.randint(1, max(1, len(ids)))]
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[:sampling.max_new_tokens], FinishReason.LENGTH
        logprobs = [-rng.random() * 6 for _ in ids]
        return Completion(ids, logprobs, finish, self.version, prompt_tokens=len(input_ids))

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def update_weights(self, named_tensors, version: int) -> None:
        self.version = version

    async def health(self) -> bool:
        return True

    async def shutdown(self) -> None:
        pass


def reply_text(rng: random.Random) -> str:
    parts = []
    if rng.random() < 0.3:
        parts.append(f"<think>{rng.choice(UNICODE)} {rng.randint(0, 99)}</think>\n")
    if rng.random() < 0.6:
        parts.append(rng.choice(UNICODE) + " " + rng.choice(UNICODE))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        if rng.random() < 0.1:
            parts.append('<tool_call>{"name": "calc", "arguments": {oops</tool_call>')  # malformed: stays content
            continue
        args = {"x": rng.choice(UNICODE), "n": rng.randint(-5, 500)}
        if rng.random() < 0.3:
            args["nested"] = {"list": [1, "二", None, True]}
        call = {"name": rng.choice(TOOL_NAMES), "arguments": args}
        parts.append(rng.choice(["", "\n"]) + f"<tool_call>{json.dumps(call, ensure_ascii=rng.random() < 0.5)}</tool_call>")
    return "".join(parts) or "ok"


# -- the oracle ----------------------------------------------------------------------------------
_SENT = "\u2063SAMPLED{}\u2063"


def check_branch(traj: Trajectory, conversation: list[dict[str, Any]], sampled_positions: list[int],
                 tools: list[dict[str, Any]] | None, engine: RecordingPolicy, tokenizer: Any) -> None:
    """Assert the TITO contract for one branch.

    ``conversation`` is the client's message list for this branch (its last request plus the reply);
    ``sampled_positions`` the indices of the assistant messages the proxy returned *on this branch*.
    """
    traj.reward = 0.0  # the owner sets rewards; validate() wants one on a completed trajectory
    traj.validate()
    stop_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    n_prompt = len(traj.prompt_ids)
    model_spans = [s for s in traj.spans if s.kind is SpanKind.MODEL]
    assert len(model_spans) == len(sampled_positions), (len(model_spans), sampled_positions)
    outputs = []
    for s in model_spans:  # sampled ids and logprobs are exactly what the engine returned for that input
        c = engine.calls[tuple(traj.tokens[:n_prompt + s.start])]
        assert traj.tokens[n_prompt + s.start:n_prompt + s.end] == c.output_ids
        assert traj.rollout_logprobs[s.start:s.end] == [float(x) for x in c.output_logprobs]
        assert s.weight_version == c.weight_version
        outputs.append(c.output_ids)
    mask = [0] * traj.response_length
    for s in model_spans:
        mask[s.start:s.end] = [1] * (s.end - s.start)
    assert traj.loss_mask == mask  # exactly the sampled tokens
    # prompt and observation ids: one render of the whole conversation, sampled turns spliced in
    raw = [dict(m) for m in conversation]
    for k, pos in enumerate(sampled_positions):
        raw[pos] = {"role": "assistant", "content": _SENT.format(k)}
    text = tokenizer.apply_chat_template(raw, tools=tools or None, tokenize=False, add_generation_prompt=False)
    expected: list[int] = []
    prev_stop = ""
    for k, out in enumerate(outputs):
        before, text = text.split(_SENT.format(k), 1)
        if prev_stop and before.startswith(prev_stop):
            before = before[len(prev_stop):]  # the template re-renders the stop token the engine sampled
        expected += tokenizer.encode(before, add_special_tokens=False) + out
        prev_stop = tokenizer.decode(out[-1:]) if out and out[-1] in stop_ids else ""
        if k == 0:
            assert traj.prompt_ids == expected[:len(expected) - len(out)]
    assert traj.tokens == expected


class ScriptEngine:
    """Replies with the given texts in order (each + EOS unless it is a Completion already); records sampling."""

    def __init__(self, tokenizer: Any, replies: list[Any], version: int = 5) -> None:
        self.tokenizer, self.replies, self.version = tokenizer, list(replies), version
        self.sampling: list[SamplingParams] = []
        self.inputs: list[list[int]] = []

    async def generate(self, input_ids, sampling: SamplingParams, *, return_routed_experts=False) -> Completion:
        self.sampling.append(sampling)
        self.inputs.append(list(input_ids))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, Completion):
            return reply
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[:sampling.max_new_tokens]
        finish = FinishReason.STOP if ids[-1] == self.tokenizer.eos_token_id else FinishReason.LENGTH
        return Completion(ids, [-0.125 * (i % 7) for i in range(len(ids))], finish, self.version, len(input_ids))
