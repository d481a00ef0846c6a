"""Identifier case conversions."""

import re


def snake_to_camel(name):
    """``foo_bar_baz`` -> ``fooBarBaz``; leading underscores are kept, repeated ones count once."""
    stripped = name.lstrip("_")
    prefix = name[: len(name) - len(stripped)]
    parts = [p for p in stripped.split("_") if p]
    if not parts:
        return name
    return prefix + parts[0] + "".join(p[:1].upper() + p[1:] for p in parts[1:])


def camel_to_snake(name):
    """``fooBar`` -> ``foo_bar``; an acronym stays one word: ``HTTPServer`` -> ``http_server``."""
    step = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    step = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", step)
    return step.lower()
