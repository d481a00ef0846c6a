from textkit import camel_to_snake, count_words, slugify, snake_to_camel, truncate, wrap
from textkit.words import most_common


def test_wrap_short_text_is_one_line():
    assert wrap("hello world", 40) == ["hello world"]


def test_wrap_long_word_gets_its_own_line():
    assert wrap("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]


def test_truncate_keeps_short_text():
    assert truncate("short", 10) == "short"


def test_slugify_simple_words():
    assert slugify("Hello World") == "hello-world"


def test_snake_to_camel_simple():
    assert snake_to_camel("foo_bar") == "fooBar"


def test_camel_to_snake_simple():
    assert camel_to_snake("fooBar") == "foo_bar"


def test_count_words_single_spaces():
    assert count_words("one two three") == 3


def test_most_common_word():
    assert most_common("b a b", 1) == ["b"]
