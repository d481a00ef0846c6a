"""The renderer's delta equals the whole-conversation render, and template-added stop text is not doubled."""

from __future__ import annotations

import pytest

from miles_agent.tito import ChatRenderer


def test_observation_delta_matches_full_render(tokenizer):
    r = ChatRenderer(tokenizer, tools=None)
    msgs = [{"role": "user", "content": "hi"}]
    ids = r.prompt_ids(msgs)
    sampled = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    history = msgs + [{"role": "assistant", "content": "hello"}]
    new = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    obs = r.observation_ids(history, new, tokenizer.decode(sampled[-1:]))
    full = r.render(history + new, add_generation_prompt=True)
    assert tokenizer.decode(ids + sampled + obs) == full


def test_length_cut_turn_gets_the_end_marker_as_observation(tokenizer):
    r = ChatRenderer(tokenizer)
    msgs = [{"role": "user", "content": "hi"}]
    sampled = tokenizer.encode("hel", add_special_tokens=False)  # no EOS: cut by max_new_tokens
    history = msgs + [{"role": "assistant", "content": "hel"}]
    obs = r.observation_ids(history, [{"role": "user", "content": "go on"}], "")
    assert tokenizer.decode(obs).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    assert tokenizer.decode(r.prompt_ids(msgs) + sampled + obs) == r.render(
        history + [{"role": "user", "content": "go on"}], add_generation_prompt=True)


def test_history_must_end_with_the_model_turn(tokenizer):
    with pytest.raises(ValueError, match="must end with the assistant turn"):
        ChatRenderer(tokenizer).observation_ids([{"role": "user", "content": "x"}], [], "")


def test_tokenizer_round_trips_bytes_and_saves(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    text = "naïve ☃ <tool_call>{\"a\": 1}</tool_call>\x00\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(text, add_special_tokens=False) == ids and again.chat_template == tokenizer.chat_template
