"""Fitting text into a width."""


def wrap(text, width):
    """Greedy word wrap: lines of at most ``width`` characters (a longer word gets a line of its own)."""
    if width < 1:
        raise ValueError("width must be at least 1")
    lines, current = [], ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if len(candidate) <= width:
            current = candidate
        else:
            if current:
                lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def truncate(text, limit, suffix="..."):
    """``text`` cut to at most ``limit`` characters, the suffix included when it was cut."""
    if len(text) <= limit:
        return text
    if limit <= len(suffix):
        return suffix[:limit]
    return text[: limit - len(suffix)] + suffix
