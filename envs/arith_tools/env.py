"""arith-tools: arithmetic a tiny model cannot do in its head, with a calculator tool it can call.

An episode: the user asks ``What is 87*25?``; the model may call the calculator --
``<tool_call>{"name": "calc", "arguments": {"expr": "87*25"}}</tool_call>``, or with no arguments to
evaluate the question itself -- reads the result from the tool response, and answers with a number
(``<answer>2175</answer>``) or with the calculator's ANS register (``<answer>ans</answer>``). Reward 1
for the right number, else 0.

Why this task: it is multi-turn (model turn, tool observation, model turn), so TITO and loss masks
are exercised; the reward is exact; and what RL must learn is agent behaviour -- use the tool rather
than guess -- which the warm start (a demonstrator that calls the tool only half the time, see
`demonstrator`) does not do reliably. A 0.8M-parameter model does not learn exact in-context copying
of digits in a few CPU minutes (measured: ~50% per digit after 1,000 SFT steps), so the demonstrator
uses the no-argument call and ANS; the explicit forms stay available to larger models.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

from miles_agent.environment import Environment, EnvSession, Reward, Task, ToolError
from miles_agent.envs.arith_tools.calc import evaluate, format_result
from miles_agent.sandbox import Sandbox

SYSTEM_PROMPT = "Use calc, then reply <answer>ans</answer>."
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "+-* calculator; no expr: the question",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
_ANSWER = re.compile(r"<answer>\s*(ans|[+-]?\d+)\s*</answer>")
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
        self.last_result: int | None = None  # the calculator's ANS register

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        self.tool_calls += 1
        if name != "calc":
            raise ToolError(f"unknown tool {name!r}; the only tool is calc")
        expr = arguments.get("expr", self.task.info["expr"])
        if not isinstance(expr, str):
            raise ToolError('calc takes {"expr": "<arithmetic>"}, or no arguments for the question')
        self.last_result = evaluate(expr)
        return format_result(self.last_result)

    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        final = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        match = _ANSWER.search(final or "")
        value = (self.last_result if match.group(1) == "ans" else int(match.group(1))) if match else None
        correct = value is not None and value == self.task.info["answer"]
        return Reward(float(correct), {"correct": float(correct), "format": float(bool(match)),
                                       "tool_calls": float(self.tool_calls)})


class ArithToolsEnv(Environment):
    name = "arith-tools"
    description = "Built-in: multi-turn arithmetic with a calculator tool (learns on CPU in minutes)."

    def __init__(self, num_tasks: int = 4096, seed: int = 1234, family_ids: bool = False) -> None:
        self.num_tasks = num_tasks
        self.seed = seed
        # env.options.family_ids=true: ids say the task family, plus-train-3 (+ and -) or times-train-3 (*),
        # so lora.routes can give each family its own adapter (docs/lora.md)
        self.family_ids = family_ids

    def tasks(self, split: str = "train") -> list[Task]:
        # "sft" holds the warm start's demonstrations, apart from the RL tasks.
        offset = {"train": 0, "eval": 1, "test": 2, "sft": 3}.get(split)
        if offset is None:
            raise ValueError(f"unknown split {split!r}; use train, eval, test or sft")
        rng = random.Random(self.seed * 10 + offset)
        n = self.num_tasks if split in ("train", "sft") else max(64, self.num_tasks // 16)
        tasks = [make_task(rng, i, split) for i in range(n)]
        if self.family_ids:
            tasks = [dataclasses.replace(t, id=f"{'times' if '*' in t.info['expr'] else 'plus'}-{t.id}") for t in tasks]
        return tasks

    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        return ArithToolsSession(task)

    def oracle_policy(self, tokenizer: Any):  # noqa: ANN201
        return self.demonstrator(tokenizer, tool_rate=1.0)

    def demonstrator(self, tokenizer: Any, tool_rate: float = 0.5, seed: int = 0):  # noqa: ANN201
        from miles_agent.envs.arith_tools.demonstrator import ArithDemonstrator

        return ArithDemonstrator(tokenizer, tool_rate=tool_rate, seed=seed)
