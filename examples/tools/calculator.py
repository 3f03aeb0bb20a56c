"""A calculator that reads Python: the user's own stand-in for the sandbox in the quickstart's code task
(examples/calculator.yaml), a function the ToRL format calls as its `python` tool.

It runs no code. It reads the program's syntax tree and evaluates only what a calculator would: numbers,
+ - * / // % ** and parentheses, names assigned earlier in the program, and `print(...)` of those, whose
output it returns. Anything else is an error the model sees, as a failed program's would be.
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _value(node: ast.AST, names: dict[str, float]) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand, names)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left, names), _value(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"a calculator cannot evaluate {ast.unparse(node)!r}")


def calculate(code: str) -> str:
    """Evaluate an arithmetic program and return what it prints.

    Args:
        code: Python statements: assignments of arithmetic expressions, and print() of them.
    """
    names: dict[str, float] = {}
    printed: list[str] = []
    for statement in ast.parse(code).body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
            names[statement.targets[0].id] = _value(statement.value, names)
        elif (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
              and isinstance(statement.value.func, ast.Name) and statement.value.func.id == "print"
              and not statement.value.keywords):
            printed.append(" ".join(str(_value(a, names)) for a in statement.value.args))
        else:
            raise ValueError(f"a calculator cannot run {ast.unparse(statement)!r}")
    return "".join(line + "\n" for line in printed)
