"""A multi grader's `calculate_output`: arithmetic over its sub-graders' scores, evaluated by `simpleeval`
(a maintained, sandboxed expression evaluator: no attribute access, no imports, bounded powers) with
OpenAI's operators `+ - * /` and `^` (a power, as OpenAI's formulas write it, binding tighter than `*`:
it is read as Python's `**`, not as Python's xor), parentheses,
numbers, the sub-graders' names, and the functions `min`, `max`, `abs`, `floor`, `ceil`, `exp`, `sqrt`
and `log`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from simpleeval import InvalidExpression, SimpleEval, safe_power

from coserve.contract.training_settings import SettingsError

_OPERATORS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                               ast.Div: operator.truediv, ast.Pow: safe_power,
                               ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS: dict[str, Any] = {"min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil,
                              "exp": math.exp, "sqrt": math.sqrt, "log": math.log}


MAX_FORMULA_CHARS = 4096


class FormulaError(ArithmeticError):
    """The formula has no value for these scores (a division by zero, the log of 0, ...)."""


def _python(formula: str) -> str:
    return formula.strip().replace("^", "**")


def _evaluator(names: Mapping[str, float]) -> SimpleEval:
    return SimpleEval(operators=_OPERATORS, functions=_FUNCTIONS, names=dict(names))


def check_formula(formula: str, grader_names: Sequence[str], param: str) -> None:
    """SettingsError (`param`) unless `formula` parses and uses only known names and functions."""
    if len(formula) > MAX_FORMULA_CHARS:
        raise SettingsError(param, f"{param} is {len(formula)} characters; at most {MAX_FORMULA_CHARS}")
    try:
        tree = ast.parse(_python(formula), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:  # ValueError: a NUL character
        reason = err.msg if isinstance(err, SyntaxError) else str(err) if isinstance(err, ValueError) \
            else "it nests too deep"
        raise SettingsError(param, f"{param} does not parse: {reason}") from None
    known = set(grader_names) | set(_FUNCTIONS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in known:
            raise SettingsError(param, f"{param} uses {node.id!r}, which is neither a grader of this multi "
                                f"grader ({', '.join(grader_names)}) nor a function ({', '.join(_FUNCTIONS)})")
        if isinstance(node, ast.expr) and not isinstance(node, ast.Name | ast.Constant | ast.BinOp | ast.UnaryOp |
                                                         ast.Call):
            raise SettingsError(param, f"{param}: only numbers, grader names, + - * / ^, parentheses and "
                                "function calls are allowed")
    try:
        evaluate(formula, dict.fromkeys(grader_names, 0.5))
    except FormulaError:
        pass  # e.g. log(a - 0.5) or 2 ^ (a * 1e6): it has a value for other scores


def evaluate(formula: str, scores: Mapping[str, float]) -> float:
    """The formula's value for these scores; FormulaError when it has none."""
    try:
        value = _evaluator(scores).eval(_python(formula))
    except (ArithmeticError, ValueError, TypeError, RecursionError, SyntaxError, InvalidExpression) as err:
        # a division by zero, log(0), a power over simpleeval's bound, min() of nothing, ...
        raise FormulaError(f"calculate_output has no value for these scores: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FormulaError(f"calculate_output gave {value!r}, not a finite number")
    return float(value)
