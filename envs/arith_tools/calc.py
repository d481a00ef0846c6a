"""The ``calc`` tool's calculator: what the environment runs for the model and the demonstrator plays."""

from __future__ import annotations

import ast
import operator

from miles_agent.environment import ToolError

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
