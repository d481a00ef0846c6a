"""dataset: prompts from a file, scored against its answers -- RLVR on your own data in one command.

    miles-agent train --recipe tiny-cpu env.name=dataset env.options.path=math.jsonl env.options.reward=math

Rows come from a ``.jsonl`` file, a ``.parquet`` file, or a folder an HF ``datasets`` object was saved to
(``save_to_disk``; a DatasetDict's split by ``split``). Each row's ``prompt_field`` is the user message (or
a list of chat messages) and ``answer_field`` the reference answer. Options: `DatasetOptions`; the full
page is docs/extensions.md.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_agent import plugins
from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.errors import UserError, require
from miles_agent.sandbox import Sandbox

REWARDS = ("exact", "math")
_TAGGED = (re.compile(r"<answer>(.*?)</answer>", re.S), re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}"))


@dataclass(frozen=True)
class DatasetOptions:
    path: str = ""  # .jsonl | .parquet | a folder saved with datasets' save_to_disk
    split: str = "train"  # the split of a saved DatasetDict that trains
    eval_split: str = ""  # a saved DatasetDict's eval split; "" = eval_path, else the last eval_fraction of rows
    eval_path: str = ""  # a separate file (or saved folder) for the eval split
    eval_fraction: float = 0.1  # share of rows held out for eval when there is no eval split or file
    prompt_field: str = "prompt"  # a string (the user message) or a list of {"role", "content"} messages
    answer_field: str = "answer"
    system_prompt: str = ""  # prepended as a system message to string prompts
    reward: str = "exact"  # exact | math (math-verify) | module:fn(task, messages) -> float | Reward
    tools: str = ""  # module:attr, a list of Python functions the model may call as tools
    max_rows: int = 0  # 0 = every row


def read_rows(path: str, split: str, key: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{key}={path}: no such file or folder; point it at a .jsonl, .parquet or a saved dataset")
    if p.is_dir():
        datasets = require("datasets", "dataset", f"{key} (a saved HF dataset folder)")
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise UserError(f"{key}={path} has splits {', '.join(ds)}, not {split!r}; set env.options.split")
            ds = ds[split]
        return [dict(r) for r in ds]
    if p.suffix == ".parquet":
        pq = require("pyarrow.parquet", "dataset", f"{key} (a Parquet file)")
        return pq.read_table(str(p)).to_pylist()
    if p.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"{key}={path}: line {n} is not JSON ({e.msg}); one JSON object per line") from None
        return rows
    raise UserError(f"{key}={path}: unknown format {p.suffix!r}; use .jsonl, .parquet or a save_to_disk folder")


def extract_answer(text: str) -> tuple[str, bool]:
    """The answer in ``<answer>...</answer>`` or ``\\boxed{...}`` (last one), else the whole text."""
    for pattern in _TAGGED:
        found = pattern.findall(text or "")
        if found:
            return found[-1].strip(), True
    return (text or "").strip(), False


def normalize(text: str) -> str:
    return " ".join(str(text).split()).rstrip(".").strip()


def math_equal(gold: str, predicted: str) -> bool:
    mv = require("math_verify", "math", "env.options.reward=math")
    # math-verify's timeouts are SIGALRM, which only the main thread may set (env workers may be threads)
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    wrapped = predicted if "\\boxed" in predicted or "$" in predicted else f"${predicted}$"
    gold_parsed = mv.parse(f"${gold}$" if "$" not in str(gold) else str(gold), parsing_timeout=limit)
    return bool(mv.verify(gold_parsed, mv.parse(wrapped, parsing_timeout=limit), timeout_seconds=limit))


def tool_schema(fn: Any) -> dict[str, Any]:
    kinds = {int: "integer", float: "number", bool: "boolean"}
    props = {n: {"type": kinds.get(p.annotation, "string")} for n, p in inspect.signature(fn).parameters.items()}
    doc = (fn.__doc__ or fn.__name__).strip().splitlines()[0]
    return {"type": "function", "function": {"name": fn.__name__, "description": doc,
                                             "parameters": {"type": "object", "properties": props}}}


class DatasetSession(EnvSession):
    def __init__(self, env: DatasetEnv, task: Task) -> None:
        self.env, self.task = env, task
        self.tools = [tool_schema(f) for f in env.tool_fns.values()]
        self.tool_calls = 0

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        self.tool_calls += 1
        fn = self.env.tool_fns.get(name)
        if fn is None:
            raise ToolError(f"unknown tool {name!r}; tools: {', '.join(self.env.tool_fns) or 'none'}")
        try:
            return str(await plugins.call(fn, **arguments))
        except TypeError as e:
            raise ToolError(f"bad arguments for {name}: {e}") from None

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        reward = self.env.options.reward
        if plugins.is_path(reward):
            got = await plugins.call(self.env.reward_fn, self.task, messages)
            return got if isinstance(got, Reward) else Reward(float(got))
        final = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        predicted, tagged = extract_answer(final)
        gold = str(self.task.info["answer"])
        correct = math_equal(gold, predicted) if reward == "math" else normalize(predicted) == normalize(gold)
        return Reward(float(correct), {"correct": float(correct), "format": float(tagged),
                                       "tool_calls": float(self.tool_calls)})


class DatasetEnv(Environment):
    name = "dataset"
    description = "Prompts and answers from JSONL / Parquet / a saved HF dataset; exact, math or custom reward."
    options_type = DatasetOptions
    options_docs = "docs/extensions.md"

    def __init__(self, **options: Any) -> None:
        self.options = opts = DatasetOptions(**options)
        if not opts.path:
            raise UserError("the dataset environment needs env.options.path=<file.jsonl | file.parquet | folder>")
        if opts.reward not in REWARDS and not plugins.is_path(opts.reward):
            raise UserError(f"env.options.reward={opts.reward!r}: choose exact, math, or module:fn")
        self.reward_fn = None
        if plugins.is_path(opts.reward):
            self.reward_fn = plugins.import_path("env.options.reward", opts.reward)
            plugins.check_call("env.options.reward", opts.reward, self.reward_fn, "fn(task, messages) -> float | Reward")
        elif opts.reward == "math":
            require("math_verify", "math", "env.options.reward=math")  # now, not at the first score
        self.tool_fns = self._tools(opts.tools)
        if not 0.0 <= opts.eval_fraction < 1.0:
            raise UserError(f"env.options.eval_fraction must lie in [0, 1) (got {opts.eval_fraction})")
        self._splits = self._load()

    def _tools(self, path: str) -> dict[str, Any]:
        if not path:
            return {}
        fns = plugins.import_path("env.options.tools", path)
        fns = list(fns.values()) if isinstance(fns, dict) else list(fns) if isinstance(fns, (list, tuple)) else [fns]
        if not fns or not all(callable(f) for f in fns):
            raise UserError(f"env.options.tools={path}: expected a list of Python functions")
        return {f.__name__: f for f in fns}

    def _load(self) -> dict[str, list[Task]]:
        o = self.options
        rows = read_rows(o.path, o.split, "env.options.path")
        if o.max_rows:
            rows = rows[: o.max_rows]
        if o.eval_path or o.eval_split:
            held = read_rows(o.eval_path or o.path, o.eval_split or o.split,
                             "env.options.eval_path" if o.eval_path else "env.options.eval_split")
        else:
            n = int(len(rows) * o.eval_fraction) if len(rows) > 1 else 0
            rows, held = (rows[:-n], rows[-n:]) if n else (rows, [])
        if not rows:
            raise UserError(f"env.options.path={o.path} has no rows to train on")
        return {"train": [self._task(r, i, "train") for i, r in enumerate(rows)],
                "eval": [self._task(r, i, "eval") for i, r in enumerate(held)]}

    def _task(self, row: dict[str, Any], index: int, split: str) -> Task:
        o = self.options
        for field_name in (o.prompt_field, o.answer_field):
            if field_name not in row and not (field_name == o.answer_field and plugins.is_path(o.reward)):
                raise UserError(f"env.options.path={o.path}: row {index} of {split} has no field {field_name!r} "
                                f"(it has {', '.join(row)}); set env.options.prompt_field / answer_field")
        prompt = row[o.prompt_field]
        if isinstance(prompt, str):
            messages = ([{"role": "system", "content": o.system_prompt}] if o.system_prompt else []) + \
                [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
        info = {"answer": row.get(o.answer_field), "row": row}
        return Task(id=str(row.get("id", f"{split}-{index}")), messages=tuple(messages), info=info)

    def tasks(self, split: str = "train") -> list[Task]:
        key = "eval" if split == "test" else split
        if key not in self._splits:
            raise ValueError(f"unknown split {split!r}; use train or eval")
        if key == "eval" and not self._splits["eval"]:
            raise ValueError("no eval rows: set env.options.eval_fraction, eval_path or eval_split")
        return self._splits[key]

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        return DatasetSession(self, task)
