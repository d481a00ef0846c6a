"""``--sglang-<arg> [value]`` command-line flags: any SGLang server argument, passed through verbatim
(``--sglang-tp-size 2`` -> ``server_args: {tp_size: 2}``; a bare ``--sglang-enable-foo`` -> true)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import yaml

PREFIX = "--sglang-"
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*=")  # a section.key=value override, never a flag value


def split_sglang_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(argv without the ``--sglang-*`` flags, {server argument: value}). ``--sglang-x=v`` is always
    unambiguous; ``--sglang-x v`` takes ``v`` unless it is another flag or a section.key=value override."""
    rest: list[str] = []
    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith(PREFIX) or len(arg) == len(PREFIX):
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg[len(PREFIX):].partition("=")
        key = name.replace("-", "_")
        if eq:
            flags[key] = _value(value)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-") and not _OVERRIDE.match(argv[i + 1]):
            flags[key] = _value(argv[i + 1])
            i += 1
        else:
            flags[key] = True
        i += 1
    return rest, flags


def _value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def with_server_args(cfg: Any, flags: dict[str, Any]) -> Any:
    """``cfg`` with ``flags`` merged over ``sglang.server_args`` (the command line wins)."""
    if not flags:
        return cfg
    return cfg.with_section("sglang", dataclasses.replace(cfg.sglang, server_args={**cfg.sglang.server_args, **flags}))
