"""A proxy session's token history: which branch a request extends, what it appends, what the model sampled.

Every request carries the agent's whole conversation. The session keeps one or more *branches*, each a
`Trajectory` under construction plus the conversation it stands for. A request that resends a branch's
conversation and adds messages *extends* it: only the chat template's delta for the new messages is
tokenized (`ChatRenderer.observation_ids`), and the sampled ids are appended as they came from the engine.
A request whose history matches no branch -- the agent summarized, dropped thinking, edited or rewound
its history -- or whose template render is not append-only starts a new branch from a fresh render, so
no loss mask ever spans a rewritten history.

Matching compares what the proxy returned with what the client sends back (role, text, tool-call names
and parsed arguments), never the re-rendered text: the token history holds the sampled ids, while the
conversation used for template deltas holds the sampled text verbatim (tool-call markup included).

Synchronous on purpose: `begin_*` and `commit` run between awaits, so one event loop needs no lock; a
branch is marked busy while its generation is in flight, and a concurrent request with the same history
forks a new branch instead of interleaving tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from miles_agent.engine import Completion, FinishReason
from miles_agent.harnesses.proxy.openai_tool_calls import split_tool_calls
from miles_agent.harnesses.proxy.protocol import ProxyError, message_key, tools_key
from miles_agent.tito import ChatRenderer, NotAppendOnly
from miles_agent.tool_calls import tool_format
from miles_agent.types import Trajectory


@dataclass(frozen=True)
class ProxyLimits:
    """Per-session limits; ``None`` means unlimited. A limit that ends the session marks it truncated."""

    max_turns: int | None = None  # model calls in the session, all branches together
    max_total_tokens: int | None = None  # tokens in one branch: prompt + everything appended
    max_new_tokens_per_turn: int = 1024  # cap (and default) for a request's max_tokens


@dataclass
class Branch:
    index: int
    chat: bool  # chat-completions branch (message matching) or completions branch (text prefix)
    traj: Trajectory
    renderer: ChatRenderer | None = None
    tools_key: str = ""
    keys: list[tuple] = field(default_factory=list)  # message_key of each message, as the client sends them
    raw: list[dict[str, Any]] = field(default_factory=list)  # what the template renders (sampled text verbatim)
    client: list[dict[str, Any]] = field(default_factory=list)  # the conversation as the client sees it
    text: str = ""  # completions branches: prompt and completions as the client sees them
    stop_text: str = ""  # text of the stop token the last turn sampled ("" when none)
    sampled: str | None = None  # the last turn's text when its raw message is structured (GLM, gpt-oss)
    busy: bool = False


@dataclass
class Pending:
    """A request between `begin_*` and `commit`: where it goes and what it appends."""

    branch: Branch
    is_new: bool
    observation: list[int]
    input_ids: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)  # new client messages (chat)
    prompt_text: str = ""  # completions: the request's prompt text
    parse_tools: bool = True
    reason: str = ""  # why a new branch was started


@dataclass
class Turn:
    """One recorded model call, ready to be shaped into a response."""

    completion: Completion
    text: str  # what the client gets (stop token / stop string removed), before tool-call parsing
    content: str | None
    tool_calls: list[dict[str, Any]]
    prompt_tokens: int
    branch: int

    @property
    def finish_reason(self) -> str:
        if self.completion.finish_reason is FinishReason.LENGTH:
            return "length"
        return "tool_calls" if self.tool_calls else "stop"


class SessionHistory:
    """The branches of one session (see module docstring)."""

    def __init__(self, tokenizer: Any, limits: ProxyLimits, stop_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.stop_ids = frozenset(stop_ids)
        self.branches: list[Branch] = []
        self.turns = 0
        self.truncated = ""  # why a limit ended the session ("" = none did)
        self.aborted = False
        self.last: Branch | None = None

    # -- starting a request -----------------------------------------------------------------------
    def begin_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   parse_tools: bool = True) -> Pending:
        self._check_turns()
        tkey, keys = tools_key(tools), [message_key(m) for m in messages]
        branch = self._longest(lambda b: b.chat and b.tools_key == tkey and b.keys == keys[:len(b.keys)])
        pending = None
        if branch is None:
            reason = self._divergence(keys, tkey)
        else:
            new = messages[len(branch.keys):]
            try:
                obs = branch.renderer.observation_ids(branch.raw, [dict(m) for m in new], branch.stop_text,
                                                      sampled_text=branch.sampled)
                pending = Pending(branch, False, obs, branch.traj.tokens + obs, messages=new)
            except NotAppendOnly as e:
                reason = f"the chat template is not append-only here: {e}"
        if pending is None:  # a new branch from one fresh render of the whole request
            renderer = ChatRenderer(self.tokenizer, tools)
            traj = Trajectory(prompt_ids=renderer.prompt_ids([dict(m) for m in messages]))
            pending = Pending(Branch(len(self.branches), True, traj, renderer, tkey), True, [],
                              list(traj.prompt_ids), messages=list(messages), reason=reason)
        pending.parse_tools = parse_tools
        return self._reserve(pending)

    def begin_text(self, prompt: str | list[int]) -> Pending:
        self._check_turns()
        if isinstance(prompt, str):
            branch = self._longest(lambda b: not b.chat and prompt.startswith(b.text), key=lambda b: len(b.text))
            obs = self._encode(prompt[len(branch.text):]) if branch else []
        else:
            n = lambda b: len(b.traj.tokens)  # noqa: E731
            branch = self._longest(lambda b: not b.chat and prompt[:n(b)] == b.traj.tokens, key=n)
            obs = list(prompt[n(branch):]) if branch else []
        if branch is not None:
            pending = Pending(branch, False, obs, branch.traj.tokens + obs)
        else:
            ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
            branch = Branch(len(self.branches), False, Trajectory(prompt_ids=ids))
            reason = "no earlier completion is a prefix" if any(not b.chat for b in self.branches) else ""
            pending = Pending(branch, True, [], list(ids), reason=reason)
        pending.prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        pending.parse_tools = False
        return self._reserve(pending)

    def release(self, pending: Pending) -> None:
        """The generation failed before anything was sampled: the branch stays as it was."""
        pending.branch.busy = False

    # -- recording what the engine sampled --------------------------------------------------------
    def commit(self, pending: Pending, c: Completion) -> Turn:
        b = pending.branch
        b.busy = False
        if pending.is_new:
            b.index = len(self.branches)
            b.traj.metadata.update(branch=b.index, **({"branch_reason": pending.reason} if pending.reason else {}))
            self.branches.append(b)
        turn = b.traj.num_turns
        if pending.observation:
            b.traj.append_observation(pending.observation, turn)
        aborted = c.finish_reason is FinishReason.ABORT
        b.traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn, trainable=not aborted,
                            version_starts=c.meta.get("weight_versions"))
        # The latest call's routing covers the whole branch (its input was the branch's every token).
        routing = c.routed_experts
        b.traj.routed_experts = routing if routing is not None and len(routing) == len(b.traj.tokens) - 1 else None
        self.turns += 1
        self.aborted = self.aborted or aborted
        self.last = b
        stop_text, raw, text = self._split_stop(c)
        fmt = tool_format(self.tokenizer)  # the model family's tool-call form
        content, calls = split_tool_calls(text, fmt) if pending.parse_tools else (text, [])
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        if b.chat:
            new = [dict(m) for m in pending.messages]
            message = fmt.assistant_message(raw)
            b.raw += new + [message]
            b.sampled = raw if message.get("content") != raw else None
            b.client += new + [reply]
            b.keys += [message_key(m) for m in new] + [message_key(reply)]
        else:
            b.text = pending.prompt_text + text
        b.stop_text = stop_text
        return Turn(c, text, content, calls, len(pending.input_ids), b.index)

    # -- reading the session ------------------------------------------------------------------------
    def trajectories(self) -> list[Trajectory]:
        """One trajectory per branch that sampled anything, as copies (the session may go on)."""
        return [_snapshot(b.traj) for b in self.branches if b.traj.num_turns]

    def final_messages(self) -> list[dict[str, Any]]:
        """The conversation of the branch the agent used last, as the agent saw it (for the verifier)."""
        return copy.deepcopy(self.last.client) if self.last and self.last.chat else []

    # -- helpers --------------------------------------------------------------------------------------
    def _reserve(self, pending: Pending) -> Pending:
        cap = self.limits.max_total_tokens
        if cap is not None and len(pending.input_ids) >= cap:
            self.truncated = f"context of {len(pending.input_ids)} tokens reached max_total_tokens={cap}"
            raise ProxyError(400, f"this session's context is {len(pending.input_ids)} tokens; its limit is "
                             f"{cap} (max_total_tokens): end the episode or shorten the history",
                             param="messages", code="context_length_exceeded", retry=False)
        pending.branch.busy = True
        return pending

    def _check_turns(self) -> None:
        if self.aborted:
            raise ProxyError(503, "the rollout engine aborted this session's generation (e.g. for a weight "
                             "update); the episode will be retried", type="server_error",
                             code="generation_aborted", retry=False)
        cap = self.limits.max_turns
        if cap is not None and self.turns >= cap:
            self.truncated = f"turn limit reached ({cap} model calls)"
            raise ProxyError(400, f"this session reached its turn limit ({cap} model calls, max_turns); end "
                             "the episode", code="turn_limit_reached", retry=False)

    def _longest(self, fits: Any, key: Any = lambda b: len(b.keys)) -> Branch | None:
        """The branch with the longest history that the request extends (the latest on ties)."""
        best = None
        for b in self.branches:
            if not b.busy and fits(b) and (best is None or key(b) >= key(best)):
                best = b
        return best

    def _divergence(self, keys: list[tuple], tkey: str) -> str:
        if not self.branches:
            return ""
        chats = [b for b in self.branches if b.chat]
        if any(b.tools_key != tkey for b in chats) and not any(b.tools_key == tkey for b in chats):
            return "the request's tools differ from every earlier request's"
        common = max((_common_prefix(b.keys, keys) for b in chats if b.tools_key == tkey), default=0)
        return f"the request's history differs from every branch at message {common}"

    def _split_stop(self, c: Completion) -> tuple[str, str, str]:
        """(text of the sampled stop token or "", the turn's text for the template, the client's text)."""
        ids, matched = c.output_ids, c.meta.get("matched_stop")
        if c.finish_reason is FinishReason.STOP and ids and not isinstance(matched, str) \
                and (ids[-1] in self.stop_ids or matched == ids[-1]):
            text = self.tokenizer.decode(ids[:-1])
            return self.tokenizer.decode(ids[-1:]), text, text
        raw = self.tokenizer.decode(ids)
        text = raw
        if c.finish_reason is FinishReason.STOP and isinstance(matched, str) and matched in raw:
            text = raw[:raw.rfind(matched)]  # OpenAI leaves the stop string out; the history keeps it
        return "", raw, text

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _snapshot(t: Trajectory) -> Trajectory:
    """A copy the session cannot change later (deepcopy is ~10x slower on long int lists)."""
    return replace(t, prompt_ids=list(t.prompt_ids), tokens=list(t.tokens), loss_mask=list(t.loss_mask),
                   rollout_logprobs=list(t.rollout_logprobs), spans=[replace(s) for s in t.spans],
                   reward_parts=dict(t.reward_parts), metadata=copy.deepcopy(t.metadata))


def _common_prefix(a: list[tuple], b: list[tuple]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
