"""The shared tool-call parser: the harness and the proxy agree block by block on what is a call."""

from miles_agent.harnesses.chat_tools import parse_tool_calls
from miles_agent.harnesses.proxy.openai_tool_calls import split_tool_calls
from miles_agent.tool_calls import scan_tool_calls, unterminated

TEXT = ('think <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> mid '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
        '<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>'
        '<tool_call>{"name": "c", "arguments": [1]}</tool_call> end')


def test_each_block_is_parsed_or_says_why_not():
    blocks = scan_tool_calls(TEXT)
    assert [(b.name, b.arguments) for b in blocks if b.ok] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert [b.error for b in blocks if not b.ok] == [
        'needs a string "name"', blocks[3].error, '"arguments" must be an object']
    assert blocks[3].error.startswith("not JSON")
    assert all(TEXT[b.start:b.end].startswith("<tool_call>") and TEXT[b.start:b.end].endswith("</tool_call>")
               for b in blocks)
    assert unterminated("x <tool_call>{") and not unterminated(TEXT)


def test_harness_and_proxy_see_the_same_calls():
    calls, errors = parse_tool_calls(TEXT)
    content, openai_calls = split_tool_calls(TEXT)
    assert [(c.name, c.arguments) for c in calls] == [
        (c["function"]["name"], __import__("json").loads(c["function"]["arguments"])) for c in openai_calls]
    assert len(errors) == 3  # the harness reports each bad block back to the model
    # the proxy keeps the malformed blocks in the content, verbatim, and drops the parsed ones
    assert content == 'think  mid <tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>' \
        '<tool_call>{"name": "c", "arguments": [1]}</tool_call> end'
