"""Sandbox backends (installed as miles_agent.sandboxes)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


def sandbox_factory(name: str, options: dict[str, Any] | None = None) -> Callable[[], Any]:
    """The backend ``name`` as a zero-argument factory with ``options`` (``env.sandbox_options``) bound,
    checked against its constructor now so that a typo fails at startup, not in the first episode."""
    from miles_agent.errors import UserError
    from miles_agent.registry import load

    cls = load("sandboxes", name)
    if not options:
        return cls
    # RemoteSandbox options (ttl_s, retry) arrive through **kwargs: look at the whole class chain.
    known = {n for c in getattr(cls, "__mro__", [cls]) if "__init__" in vars(c)
             for n, p in inspect.signature(vars(c)["__init__"]).parameters.items()
             if n != "self" and p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UserError(f"env.sandbox_options: {', '.join(unknown)} not accepted by the {name!r} sandbox; "
                        f"valid options: {', '.join(sorted(known - {'sleep', 'sdk'}))} (see docs/sandboxes.md)")
    return functools.partial(cls, **options)
