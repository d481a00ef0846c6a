"""arith-tools: arithmetic a tiny model cannot do in its head, with a calculator tool it can call.

An episode: the user asks ``What is 347*29-18?``; the model may call
``<tool_call>{"name": "calc", "arguments": {"expr": "347*29-18"}}</tool_call>``, reads the result from
the tool response, and answers ``<answer>10045</answer>``. Reward 1 for the right number, else 0.

Why this task: it is multi-turn (model turn, tool observation, model turn), so TITO and loss masks
are exercised; the reward is exact; and what RL must learn is real agent behaviour -- use the tool
and copy its result faithfully -- which the warm start (a demonstrator that calls the tool only
half the time, see `demonstrator`) does not yet do reliably.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.sandbox import Sandbox

SYSTEM_PROMPT = "Use calc, then reply <answer>N</answer>."
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "+-* calculator",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}
_ANSWER = re.compile(r"<answer>\s*([+-]?\d+)\s*</answer>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expr: str) -> int:
    """Integer arithmetic with + - * and parentheses; anything else is a ToolError for the model to read."""
    if len(expr) > 64:
        raise ToolError("expression too long (64 characters at most)")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expr!r}; use integers with + - * and parentheses") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ToolError(f"unsupported expression {expr!r}; use integers with + - * and parentheses")

    value = ev(tree)
    if abs(value) > 10**12:
        raise ToolError("result too large")
    return value


def format_result(value: int) -> str:
    """The calculator's display: signed, zero-padded to 4 digits (``+0347``), like a fixed-width readout."""
    return f"{value:+05d}"


def make_task(rng: random.Random, index: int, split: str) -> Task:
    # Fixed width (two 2-digit operands): with the calculator's fixed-width readout, every copy the
    # model makes is at a constant distance -- easy to learn for a tiny model, exact to verify.
    expr = f"{rng.randint(10, 99)}{rng.choice('+-*')}{rng.randint(10, 99)}"
    messages = ({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {expr}?"})
    return Task(id=f"{split}-{index}", messages=messages, info={"expr": expr, "answer": evaluate(expr)})


class ArithToolsSession(EnvSession):
    tools = [CALC_TOOL]

    def __init__(self, task: Task) -> None:
        self.task = task
        self.tool_calls = 0

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        self.tool_calls += 1
        if name != "calc":
            raise ToolError(f"unknown tool {name!r}; the only tool is calc")
        expr = arguments.get("expr")
        if not isinstance(expr, str):
            raise ToolError('calc takes {"expr": "<arithmetic>"}')
        return format_result(evaluate(expr))

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        final = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        match = _ANSWER.search(final or "")
        correct = bool(match) and int(match.group(1)) == self.task.info["answer"]
        return Reward(float(correct), {"correct": float(correct), "format": float(bool(match)),
                                       "tool_calls": float(self.tool_calls)})


class ArithToolsEnv(Environment):
    name = "arith-tools"
    description = "Built-in: multi-turn arithmetic with a calculator tool (learns on CPU in minutes)."

    def __init__(self, num_tasks: int = 4096, seed: int = 1234) -> None:
        self.num_tasks = num_tasks
        self.seed = seed

    def tasks(self, split: str = "train") -> list[Task]:
        # "sft" holds the warm start's demonstrations, apart from the RL tasks.
        offset = {"train": 0, "eval": 1, "test": 2, "sft": 3}.get(split)
        if offset is None:
            raise ValueError(f"unknown split {split!r}; use train, eval, test or sft")
        rng = random.Random(self.seed * 10 + offset)
        n = self.num_tasks if split in ("train", "sft") else max(64, self.num_tasks // 16)
        return [make_task(rng, i, split) for i in range(n)]

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        return ArithToolsSession(task)

    def oracle_policy(self, tokenizer: Any):  # noqa: ANN201
        return self.demonstrator(tokenizer, tool_rate=1.0)

    def demonstrator(self, tokenizer: Any, tool_rate: float = 0.5, seed: int = 0):  # noqa: ANN201
        from miles_agent.envs.arith_tools.demonstrator import ArithDemonstrator

        return ArithDemonstrator(tokenizer, tool_rate=tool_rate, seed=seed)
