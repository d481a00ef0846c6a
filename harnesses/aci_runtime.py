"""The agent-computer interface's commands, as they run inside the sandbox: ``python3 -c SOURCE ARGS``.

Standalone on purpose -- stdlib only, any Python 3.8+ -- because the harness sends this file's source
through the environment's ``bash`` tool; nothing of miles-agent exists in the sandbox. ARGS is the call
as base64 JSON ``{"op": ..., ...}``. Output is what the model reads; exit code 1 means the command was
refused (a bad path, an edit that does not parse), and then nothing was changed.
"""

import base64
import json
import os
import sys

WINDOW = 100  # lines shown by view when no range is asked
MAX_MATCHES = 50
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules", ".venv"}


class Refused(Exception):
    pass


def _read(path):
    if os.path.isdir(path):
        raise Refused(f"{path} is a folder; view it to list it, or give a file")
    if not os.path.isfile(path):
        raise Refused(f"no file {path}")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _numbered(lines, start):
    width = len(str(start + len(lines) - 1))
    return "\n".join(f"{n:>{width}}| {line}" for n, line in enumerate(lines, start))


def view(path, start=1, end=None):
    if os.path.isdir(path):
        entries = sorted(e + ("/" if os.path.isdir(os.path.join(path, e)) else "") for e in os.listdir(path)
                         if e not in SKIP_DIRS)
        return f"[folder {path}: {len(entries)} entries]\n" + "\n".join(entries)
    lines = _read(path).splitlines()
    start = max(1, int(start))
    end = min(len(lines), int(end) if end is not None else start + WINDOW - 1)
    if lines and start > len(lines):
        raise Refused(f"{path} has {len(lines)} lines; start at or before line {len(lines)}")
    more = f"; {len(lines) - end} more below (view from line {end + 1})" if end < len(lines) else ""
    return f"[{path}: {len(lines)} lines, showing {start}-{end}{more}]\n" + _numbered(lines[start - 1:end], start)


def _walk(top):
    out = []
    for root, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        out += [os.path.join(root, name) for name in sorted(names)]
    return out


def search(pattern, path="."):
    if not pattern:
        raise Refused("search needs a non-empty pattern")
    files = [path] if os.path.isfile(path) else _walk(path)
    if not files:
        raise Refused(f"no file or folder {path}")
    hits = []
    for name in files:
        try:
            with open(name, encoding="utf-8") as f:
                hits += [f"{os.path.normpath(name)}:{n}: {line.rstrip()}" for n, line in enumerate(f, 1) if pattern in line]
        except (UnicodeDecodeError, OSError):
            continue
    if not hits:
        return f"no match for {pattern!r} in {path}"
    shown = hits[:MAX_MATCHES]
    extra = f"\n[{len(hits) - MAX_MATCHES} more matches not shown; narrow the search]" if len(hits) > MAX_MATCHES else ""
    return f"[{len(hits)} matches for {pattern!r} in {path}]\n" + "\n".join(shown) + extra


def _lint(path, text):
    """A Python file must still compile: the error and its line, or None."""
    if not path.endswith(".py"):
        return None
    try:
        compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        return f"{e.msg} at line {e.lineno}"
    except ValueError as e:
        return str(e)
    return None


def _write_checked(path, old_text, new_text, around):
    problem = _lint(path, new_text)
    if problem:
        lines = new_text.splitlines()
        lo = max(1, around[0] - 3)
        shown = _numbered(lines[lo - 1:around[1] + 3], lo)
        raise Refused(f"edit rejected, {path} left unchanged: the result does not parse ({problem}). "
                      f"It would have read:\n{shown}\nFix the edit (indentation, brackets) and try again.")
    with open(path, "w", encoding="utf-8") as f:
        f.write(new_text)
    lines = new_text.splitlines()
    lo, hi = max(1, around[0] - 3), min(len(lines), around[1] + 3)
    return f"[{path} edited; lines {lo}-{hi} now read]\n" + _numbered(lines[lo - 1:hi], lo)


def edit(path, start, end, content):
    """Replace lines start..end (inclusive) with ``content``; end = start - 1 inserts before start."""
    text = _read(path)
    lines = text.splitlines(keepends=True)
    start, end = int(start), int(end)
    if not (1 <= start <= len(lines) + 1 and start - 1 <= end <= len(lines)):
        raise Refused(f"{path} has {len(lines)} lines: need 1 <= start <= {len(lines) + 1} and start-1 <= end <= "
                      f"{len(lines)} (got start={start}, end={end})")
    new = content if content.endswith("\n") or not content else content + "\n"
    if lines and not lines[-1].endswith("\n") and end == len(lines):
        new = new.rstrip("\n")
    new_text = "".join(lines[:start - 1]) + new + "".join(lines[end:])
    return _write_checked(path, text, new_text, (start, start + max(0, new.count("\n") - 1)))


def replace(path, old, new):
    text = _read(path)
    count = text.count(old) if old else 0
    if count != 1:
        raise Refused(f"the text to replace occurs {count} times in {path}; it must occur exactly once "
                      "(give more surrounding lines)" if old else "replace needs the exact text to replace")
    at = text[:text.index(old)].count("\n") + 1
    return _write_checked(path, text, text.replace(old, new), (at, at + new.count("\n")))


def create(path, content):
    if os.path.exists(path):
        raise Refused(f"{path} exists; edit it instead")
    problem = _lint(path, content)
    if problem:
        raise Refused(f"{path} not created: it does not parse ({problem})")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)
    return f"[created {path}: {len(content.splitlines())} lines]"


OPS = {"view": view, "search": search, "edit": edit, "replace": replace, "create": create}


def main():
    call = json.loads(base64.b64decode(sys.argv[1]).decode())
    op = OPS[call.pop("op")]
    try:
        print(op(**call))
    except Refused as e:
        print(f"error: {e}")
        sys.exit(1)
    except (TypeError, ValueError) as e:
        print(f"error: bad arguments: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
