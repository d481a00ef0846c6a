"""``model.chat_template_kwargs`` reaches the chat template: on Qwen3's template (a fixture in its public
shape) ``enable_thinking: false`` opens every reply with an empty think block, and a tool episode rendered
turn by turn still equals the full render (TITO stays append-only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_agent.tito import ChatRenderer, with_chat_options

pytest.importorskip("transformers")
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def qwen3_tokenizer():
    from miles_agent.models.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return tok


def test_enable_thinking_false_reaches_the_template():
    msgs = [{"role": "user", "content": "2+3?"}]
    plain = ChatRenderer(qwen3_tokenizer(), TOOLS).render(msgs, add_generation_prompt=True)
    off = ChatRenderer(with_chat_options(qwen3_tokenizer(), {"enable_thinking": False}), TOOLS)
    text = off.render(msgs, add_generation_prompt=True)
    assert plain.endswith("<|im_start|>assistant\n") and text == plain + "<think>\n\n</think>\n\n"
    tok = off.tokenizer
    assert tok.decode(off.prompt_ids(msgs)) == text


def test_a_tool_episode_stays_append_only_with_thinking_off():
    tok = with_chat_options(qwen3_tokenizer(), {"enable_thinking": False})
    r = ChatRenderer(tok, TOOLS)
    msgs = [{"role": "user", "content": "2+3?"}]
    ids = r.prompt_ids(msgs)
    turn = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    sampled = tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]
    history = msgs + [{"role": "assistant", "content": turn}]
    new = [{"role": "tool", "content": "5"}]
    ids += sampled + r.observation_ids(history, new, tok.decode(sampled[-1:]))
    assert tok.decode(ids) == r.render(history + new, add_generation_prompt=True)
    assert tok.decode(ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_run_tokenizer_carries_the_recipe_kwargs():
    from miles_agent.build import build_env
    from miles_agent.config import load_config
    from miles_agent.models.loading import load_policy

    cfg = load_config("tiny-cpu", {"model.warm_start": None, "model.chat_template_kwargs": {"enable_thinking": False}})
    _, tok = load_policy(cfg, build_env(cfg))
    assert ChatRenderer(tok).template_kwargs == {"enable_thinking": False}
    assert load_config("qwen3-0.6b-1gpu").model.chat_template_kwargs == {"enable_thinking": False}
