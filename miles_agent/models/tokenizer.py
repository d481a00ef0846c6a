"""A byte-level tokenizer built offline, with a Qwen-style chat template that supports tool calls.

Every byte is one token (no merges), so any text round-trips exactly and no hub download is needed.
It is a real ``transformers.PreTrainedTokenizerFast``: ``save_pretrained`` / ``AutoTokenizer`` load it
like any HF tokenizer, and the rest of the stack only ever uses the HF tokenizer interface.
"""

from __future__ import annotations

from functools import lru_cache

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup the model writes or reads, one token each (as in Qwen): added tokens, not special ones, so
# decoding keeps them.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# A vision tokenizer's image markers (Qwen-VL's): one <|image_pad|> per image in a render, which the harness
# expands to the image's placeholder count (miles_agent.models.vision.placeholder_count).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen3's layout made compact: byte-level sequences are long, so the tool preamble is one line per tool.
CHAT_TEMPLATE = (
    # No whitespace-control dashes: the template is one line, and every newline below is meant.
    # transformers renders with trim_blocks, so a newline right after a tag is written as {{ nl }}.
    "{% set nl = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ nl }}{% endif %}"
    "# Tools"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}"
    "Call: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>{{ nl }}"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "<|im_start|>user\n{{ message.content }}<|im_end|>{{ nl }}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": {{ fn.name | tojson }}, \"arguments\": "
    "{{ fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ nl }}"
    "{% elif message.role == 'tool' %}"
    # Consecutive tool results share one user turn: render the whole conversation, never one message.
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ nl }}<tool_response>{{ message.content }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ nl }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)


# Message content given as parts ({"type": "image"} / {"type": "text", "text": ...}) renders each image as
# Qwen-VL's <|vision_start|><|image_pad|><|vision_end|>; a string renders as itself.
VISION_CONTENT = (
    "{% macro content(c) %}{% if c is string %}{{ c }}{% else %}{% for part in c %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
)


def build_byte_tokenizer(vision: bool = False):  # -> transformers.PreTrainedTokenizerFast
    """Build the tokenizer from nothing: 256 byte tokens, then the special and markup tokens (and with
    ``vision`` the image markers, and a template that renders image content parts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = _bytes_to_unicode()
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:] + (VISION_TOKENS if vision else []),
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens(MARKUP_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    if vision:
        tok.chat_template = VISION_CONTENT + CHAT_TEMPLATE.replace("{{ message.content }}",
                                                                    "{{ content(message.content) }}")
    tok.model_max_length = 1 << 16
    return tok


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def stop_token_ids(tokenizer) -> tuple[int, ...]:  # noqa: ANN001
    """Ids that end an assistant turn: EOS and, where the vocabulary has them, the chat end markers and the
    stop tokens of the model's family."""
    ids = {tokenizer.eos_token_id}
    family = getattr(tokenizer, "tool_call_format", None)  # a family's own turn ends (GLM's <|observation|>)
    for t in ("<|im_end|>", "<|endoftext|>", *getattr(family, "stop_tokens", ())):
        tid = tokenizer.convert_tokens_to_ids(t)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return tuple(sorted(i for i in ids if i is not None))
