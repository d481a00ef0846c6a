"""Counting words."""


def count_words(text):
    """The number of whitespace-separated words (any run of spaces, tabs or newlines separates)."""
    return len(text.split())


def most_common(text, n=1):
    """The ``n`` most frequent lowercase words, ties in order of first appearance."""
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return [w for w, _ in sorted(counts.items(), key=lambda kv: -kv[1])[:n]]
