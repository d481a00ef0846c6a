"""Plug-ins of every kind, found by entry point or ``module:attr`` -- the only way the core reaches them.

Each kind is an entry-point group (``miles_agent.envs`` ...). A third-party package registers one in
its own pyproject and ``miles-agent envs list`` shows it. A plug-in that fails to import is reported by
name with its cause; it never hides the others. What each kind's entry point must be is in
docs/architecture.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from dataclasses import dataclass
from typing import Any

from miles_agent.errors import UserError

KINDS = {"envs": "environment", "harnesses": "harness", "sandboxes": "sandbox", "trainers": "trainer",
         "engines": "rollout engine", "transports": "weight transport", "clusters": "cluster mode",
         "critics": "critic", "sections": "config section", "planners": "placement planner",
         "families": "chat/tool-call format"}


@dataclass
class PluginInfo:
    name: str
    package: str
    target: str
    description: str = ""
    error: str | None = None  # why it could not be loaded


def group(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(f"unknown plug-in kind {kind!r}; choose one of {', '.join(KINDS)}")
    return f"miles_agent.{kind}"


def _entry_points(kind: str) -> dict[str, md.EntryPoint]:
    found: dict[str, md.EntryPoint] = {}
    for ep in md.entry_points(group=group(kind)):
        found.setdefault(ep.name, ep)
    return found


def list_plugins(kind: str) -> list[PluginInfo]:
    """Every registered plug-in of a kind, loaded to read its description; failures are kept, not raised."""
    out = []
    for name, ep in sorted(_entry_points(kind).items()):
        package = ep.dist.name if ep.dist else "?"
        info = PluginInfo(name=name, package=package, target=ep.value)
        try:
            obj = ep.load()
            info.description = _describe(obj)
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not hide the others
            info.error = f"{type(e).__name__}: {e}"
        out.append(info)
    return out


def names(kind: str) -> list[str]:
    """The installed entry-point names of a kind, without loading them."""
    return sorted(_entry_points(kind))


def resolve_attr(path: str) -> Any:
    """The object ``module:attr`` names (``attr`` may be dotted); ImportError / AttributeError when absent."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load(kind: str, name: str, key: str = "") -> Any:
    """The plug-in object named ``name`` (an entry-point name or ``module:attr``); ``key`` is the config
    key that chose it, named in the error when there is no such plug-in."""
    if ":" in name:
        try:
            return resolve_attr(name)
        except (ImportError, AttributeError) as e:
            raise UserError(f"cannot load {KINDS[kind]} {name!r}: {type(e).__name__}: {e}; "
                            "check the module path and that its package is installed") from None
    eps = _entry_points(kind)
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        where = f" ({key}={name})" if key else ""
        raise UserError(f"unknown {KINDS[kind]} {name!r}{where}; installed: {known} "
                        f"(see `miles-agent {kind} list`, or pass module:attr)")
    try:
        return eps[name].load()
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{KINDS[kind]} plug-in {name!r} ({eps[name].value}) failed to load: "
                        f"{type(e).__name__}: {e}; fix or reinstall its package") from None


def _describe(obj: Any) -> str:
    desc = getattr(obj, "description", "") or ""
    if not desc and obj.__doc__:
        desc = obj.__doc__.strip().splitlines()[0]
    return str(desc)
