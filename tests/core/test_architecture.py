"""The layout's rules, checked on the source (docs/architecture.md explains them):

* the core (``miles_agent/``) never imports a plug-in folder -- it finds plug-ins through the registry;
* no two modules import each other, directly or around a circle (lazy imports count too);
* no file is over 600 lines, and the core stays within its line budget.

Imports are read with ``ast`` from the folders pyproject.toml installs under ``miles_agent``, so a new
plug-in folder is checked as soon as it is mapped there.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = "miles_agent"
CORE_BUDGET = 7600  # lines of miles_agent/**/*.py (7,500 until the vision-language inputs, models/vision.py, joined)
MAX_FILE_LINES = 600


def _packages() -> dict[str, str]:
    """package name -> folder, as installed (``miles_agent.envs`` -> ``envs``)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in _packages().items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if package == CORE and any(name.startswith(p + ".") or name == p for p in _packages() if p != CORE):
                continue  # a plug-in package nested under the core's name is not the core
            mods[name] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (``from pkg import mod`` -> ``pkg.mod``)."""
    def known(target: str) -> str:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.startswith(CORE)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.startswith(CORE):
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base) for a in node.names}
    return found - {"", name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _plugin_packages() -> list[str]:
    return [p for p in _packages() if p != CORE]


def _is_plugin(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _plugin_packages())


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_core_imports_no_plugin_folder():
    graph = _graph()
    leaks = sorted(f"{m} -> {t}" for m, targets in graph.items() if not _is_plugin(m)
                   for t in targets if _is_plugin(t))
    assert not leaks, f"the core must reach plug-ins through miles_agent.registry only: {leaks}"


def test_no_import_circle():
    assert not _cycles(_graph()), f"import circles: {_cycles(_graph())}"


def test_the_checker_sees_a_circle_and_the_plugins():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "miles_agent.loop" in graph and "miles_agent.engines.embedded.engine" in graph
    assert "miles_agent.registry" in graph["miles_agent.loop"] or "miles_agent.components" in graph["miles_agent.loop"]


def test_no_file_is_over_the_limit():
    folders = {*_packages().values(), "tests", "bench"}
    long = sorted(f"{p.relative_to(ROOT)} ({n})" for folder in folders for p in (ROOT / folder).rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES)
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}; split them by concept"


def test_the_core_stays_within_its_line_budget():
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / CORE).rglob("*.py"))
    assert lines <= CORE_BUDGET, f"miles_agent/ holds {lines} lines (budget {CORE_BUDGET}): move a backend out"
