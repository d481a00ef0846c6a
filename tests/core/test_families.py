"""Each model family's chat template and tool-call format, end to end through the chat-tools harness.

Per family (Qwen3, Hermes, DeepSeek-V3, Kimi-K2, GLM-4.5, gpt-oss), on a fixture template written in the
shape of the family's public one and an offline byte tokenizer holding the family's special tokens: the
model "samples" exactly what the template renders for a parallel tool-call turn and a final answer; the
harness must parse the calls the template rendered, run them, and keep one token history that decodes to
the whole conversation's render (TITO stays append-only, no branch).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.environment import EnvSession, HarnessLimits, Reward, Task
from miles_agent.tito import ChatRenderer, with_chat_options
from miles_agent.tool_calls import choose_format

pytest.importorskip("transformers")
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
CALLS = [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]

# family -> (template, model_type its config.json names, added tokens, eos, special token overrides,
#            what ends the call turn and the answer turn when the render holds no stop token)
FAMILIES = {
    "qwen3": ("qwen3.jinja", "qwen3", [], None, {}, ()),
    "hermes": ("hermes.jinja", "llama", [], None, {}, ()),
    "deepseek-v3": ("deepseek_v3.jinja", "deepseek_v3",
                    ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"], "<｜end▁of▁sentence｜>",
                    {"bos_token": "<｜begin▁of▁sentence｜>"}, ()),
    "kimi-k2": ("kimi_k2.jinja", "kimi_k2",
                ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
                 "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>"], None, {}, ()),
    "glm-4.5": ("glm_4_5.jinja", "glm4_moe",
                ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<arg_key>",
                 "</arg_key>", "<arg_value>", "</arg_value>"], "<|endoftext|>", {}, ("<|observation|>", "<|user|>")),
    "gpt-oss": ("gpt_oss.jinja", "gpt_oss",
                ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"], "<|return|>",
                {}, ("<|call|>", "<|return|>")),
}


def family_tokenizer(family: str):
    from miles_agent.models.tokenizer import build_byte_tokenizer

    template, _, tokens, eos, special, _ = FAMILIES[family]
    tok = build_byte_tokenizer()
    tok.add_tokens(tokens)
    extra = {**special, **({"eos_token": eos} if eos else {})}
    if extra:
        tok.add_special_tokens(extra)
    tok.chat_template = (TEMPLATES / template).read_text()
    return with_chat_options(tok, {"enable_thinking": False} if family == "glm-4.5" else {}, choose_format(family))


def family_calls(family: str) -> list[tuple[str, dict]]:
    return CALLS[:1] if family == "gpt-oss" else CALLS  # harmony: the <|call|> stop token ends the turn at one call


def conversation(family: str) -> tuple[list[dict], dict, list[dict], dict]:
    """(opening messages, the call turn, its tool results, the answer turn) as the template's inputs."""
    CALLS = family_calls(family)  # noqa: N806
    opening = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3 and 4+5?"}]
    ids = [f"functions.add:{i}" for i in range(len(CALLS))] if family == "kimi-k2" else [None] * len(CALLS)
    calls = [{"type": "function", **({"id": i} if i else {}), "function": {"name": n, "arguments": a}}
             for (n, a), i in zip(CALLS, ids)]
    turn = {"role": "assistant", "content": "" if family in ("glm-4.5", "gpt-oss") else "Let me add.",
            "tool_calls": calls}
    if family == "gpt-oss":
        turn["thinking"] = "Two sums."
    results = [{"role": "tool", "content": str(a["a"] + a["b"]), "name": n, **({"tool_call_id": i} if i else {})}
               for (n, a), i in zip(CALLS, ids)]
    return opening, turn, results, {"role": "assistant", "content": "5 and 9."}


def sampled_text(renderer: ChatRenderer, before: list[dict], turn: dict, stops: tuple[str, ...], end: str) -> str:
    """What the model samples for ``turn``: the template's render of it, cut after its stop token (or, for a
    template with no end-of-turn token, followed by the tag that stops it)."""
    prompt = renderer.render(before, add_generation_prompt=True)
    full = renderer.render(before + [turn], add_generation_prompt=False)
    assert full.startswith(prompt)
    text = full[len(prompt):]
    cut = [text.index(s) + len(s) for s in stops if s in text]
    return text[:min(cut)] if cut else text + end


class Replay:
    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.sampled = tokenizer, list(texts), []

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        assert ids[-1] in sampling.stop_token_ids, "the turn must end on a stop token the harness knows"
        self.sampled.append(ids)
        return Completion(ids, [-0.5] * len(ids), FinishReason.STOP, 0, prompt_tokens=len(input_ids))


class Adder(EnvSession):
    tools = [ADD]

    def __init__(self) -> None:
        self.calls, self.final = [], None

    async def call_tool(self, name, arguments):
        self.calls.append((name, arguments))
        return str(arguments["a"] + arguments["b"])

    async def score(self, messages):
        self.final = messages
        return Reward(1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_conversation_round_trips_through_the_harness(family):
    from miles_agent.harnesses.chat_tools import ChatToolsHarness

    tok = family_tokenizer(family)
    stop_tokens = (tok.eos_token, "<|im_end|>", *tok.tool_call_format.stop_tokens)
    ends = FAMILIES[family][5] or (tok.eos_token, tok.eos_token)
    r = ChatRenderer(tok, [ADD])
    opening, turn, results, answer = conversation(family)
    call_text = sampled_text(r, opening, turn, stop_tokens, ends[0])
    answer_text = sampled_text(r, opening + [turn] + results, answer, stop_tokens, ends[1])
    policy, session = Replay(tok, [call_text, answer_text]), Adder()
    harness = ChatToolsHarness(tok, HarnessLimits(max_turns=4, max_total_tokens=1 << 15, max_new_tokens_per_turn=4096),
                               SamplingParams(max_new_tokens=4096))
    (traj,) = asyncio.run(harness.run(Task("t", tuple(opening)), session, policy))
    assert "branch_reason" not in traj.metadata
    assert session.calls == family_calls(family)  # the calls parsed from the sampled text are the ones the template rendered
    # the harness's messages stand for the same conversation: they render to the same text
    intended = r.render(opening + [turn] + results + [answer], add_generation_prompt=False)
    assert r.render(session.final, add_generation_prompt=False) == intended
    # one token history: prompt + sampled + observations decodes to that render, up to the answer's stop
    text = tok.decode(traj.tokens)
    assert text.startswith(r.render(opening + [turn] + results, add_generation_prompt=True))
    assert text.endswith(answer_text) and intended.startswith(text[: -len(tok.decode(traj.tokens[-1:]))])
    assert [t for t, m in zip(traj.response_ids, traj.loss_mask) if m] == [i for ids in policy.sampled for i in ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_is_chosen_from_the_model_config(family):
    fmt = choose_format("auto", SimpleNamespace(model_type=FAMILIES[family][1]))
    assert fmt.name == ("qwen3" if family == "hermes" else family)


def test_an_unknown_family_names_the_choices():
    from miles_agent.errors import UserError

    with pytest.raises(UserError, match="model.family=mistral.*installed:.*glm-4.5"):
        choose_format("mistral")


@pytest.mark.parametrize("family, text, error", [
    ("deepseek-v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{oops}\n```<｜tool▁call▁end｜>", "not JSON"),
    ("kimi-k2", "<|tool_call_begin|>add<|tool_call_argument_begin|>{}<|tool_call_end|>", "functions.NAME:INDEX"),
    ("glm-4.5", "<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "function name"),
    ("gpt-oss", "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 2", "not JSON"),
])
def test_a_malformed_call_is_an_error_the_model_sees(family, text, error):
    from miles_agent.harnesses.chat_tools import parse_tool_calls

    fmt = choose_format(family)
    calls, errors = parse_tool_calls(text, fmt)
    assert not calls and len(errors) == 1 and error in errors[0] and fmt.example in errors[0]


def test_glm_values_keep_their_types_and_strings_stay_bare():
    fmt = choose_format("glm-4.5")
    (block,) = fmt.scan("<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls -la</arg_value>\n"
                        "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
                        '<arg_value>{"x": [1, 2]}</arg_value>\n</tool_call>')
    assert (block.name, block.arguments) == ("run", {"cmd": "ls -la", "n": 3, "opts": {"x": [1, 2]}})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_proxy_reads_the_family_and_extends_one_branch(family):
    """The OpenAI-compatible proxy: the sampled call turn comes back to the agent as ``tool_calls``, and the
    agent's next request (its reply and the tool results) extends the same token history."""
    from miles_agent.harnesses.proxy.history import ProxyLimits, SessionHistory
    from miles_agent.models.tokenizer import stop_token_ids

    tok = family_tokenizer(family)
    r = ChatRenderer(tok, [ADD])
    opening, turn, results, _ = conversation(family)
    stops = (tok.eos_token, "<|im_end|>", *tok.tool_call_format.stop_tokens)
    call_text = sampled_text(r, opening, turn, stops, (FAMILIES[family][5] or (tok.eos_token,))[0])
    history = SessionHistory(tok, ProxyLimits(), stop_token_ids(tok))
    pending = history.begin_chat(opening, [ADD])
    ids = tok.encode(call_text, add_special_tokens=False)
    reply = history.commit(pending, Completion(ids, [-0.5] * len(ids), FinishReason.STOP, 0))
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]
    assert got == family_calls(family)
    answer = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
    tool_msgs = [{**m, "tool_call_id": c["id"]} for m, c in zip(results, reply.tool_calls)]
    nxt = history.begin_chat(opening + [answer] + tool_msgs, [ADD])
    assert not nxt.is_new, nxt.reason  # one branch: the template's delta only
    assert tok.decode(nxt.input_ids) == r.render(opening + [turn] + tool_msgs, add_generation_prompt=True)
