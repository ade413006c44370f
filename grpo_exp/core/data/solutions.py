"""Worked solutions for supervised fine-tuning: the text a model is taught to write for a problem.

A generated problem carries its computation (`expression`); its solution writes each operation in the order it is
evaluated, one sentence each, and ends with the line the reward asks for ("47 - 19 = 28.\nThe answer is 28."). A
GSM8K problem has the dataset's own rationale, whose calculator annotations (<<3*4=12>>) are dropped. The answer
line is the one the system prompt asks for, so the correctness and format rewards both score a solution 1.
"""

from __future__ import annotations

import ast
import re

_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/"}
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def _number(text: str) -> str:
    return str(int(text)) if re.fullmatch(r"[-+]?\d+", text) else text


def _steps(expression: str) -> tuple[list[str], int]:
    """The operations of `expression` in evaluation order, each written "a op b = c", and the value."""
    steps: list[str] = []

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOL:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                result = left + right
            elif isinstance(node.op, ast.Sub):
                result = left - right
            elif isinstance(node.op, ast.Mult):
                result = left * right
            else:
                if right == 0 or left % right:
                    raise ValueError(f"{expression!r} divides {left} by {right}, which has a remainder")
                result = left // right
            steps.append(f"{left} {_SYMBOL[type(node.op)]} {right} = {result}")
            return result
        raise ValueError(f"cannot write a solution for {expression!r}: unsupported {type(node).__name__}")

    total = value(ast.parse(expression, mode="eval"))
    return steps, total


def worked_solution(problem: dict) -> str:
    """The solution text of one problem (a generated one with `expression`, or a GSM8K one with `rationale`), ending
    with "The answer is <answer>."; a problem with neither is a ValueError naming its keys."""
    answer = _number(str(problem["answer"]))
    if problem.get("expression"):
        steps, total = _steps(problem["expression"])
        if str(total) != answer:
            raise ValueError(f"{problem['expression']!r} evaluates to {total}, not the problem's answer {answer}")
        body = " ".join(f"{step}." for step in steps) or f"{answer}."
    elif problem.get("rationale"):
        body = _CALCULATOR.sub("", problem["rationale"]).strip()
    else:
        raise ValueError(f"a worked solution needs a generated problem's 'expression' or a GSM8K 'rationale'; this "
                         f"problem has {sorted(problem)}")
    return f"{body}\nThe answer is {answer}."
