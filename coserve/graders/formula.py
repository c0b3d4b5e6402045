"""A multi grader's `calculate_output`: arithmetic over its sub-graders' scores, evaluated by `simpleeval`
(a maintained, sandboxed expression evaluator: no attribute access, no imports, bounded powers) with
OpenAI's operators `+ - * /` and `^` (a power, as OpenAI's formulas write it, binding tighter than `*`:
it is read as Python's `**`, not as Python's xor), parentheses,
numbers, the sub-graders' names, and the functions `min`, `max`, `abs`, `floor`, `ceil`, `exp`, `sqrt`
and `log`.

Bounded by construction: every operand is converted to a float before an operator or a function sees it
and every operation is a float operation (`^` is `math.pow`), so no value grows past a float (1.8e308:
beyond it an operation raises OverflowError, never builds a huge integer: Python's own `**` on integers
would compute `4000000^1000000`'s 22 million bits), each operation takes constant time, and a formula of at
most `MAX_FORMULA_CHARS` characters does a bounded number of them; a clock checked at every operation stops
one past `MAX_FORMULA_S` all the same. A formula with no value (an overflow, a division by zero, the log of
0) is a `FormulaError`: the sample's `formula_parse_error`.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from simpleeval import InvalidExpression, SimpleEval

from coserve.contract.training_settings import SettingsError

MAX_FORMULA_CHARS = 4096
MAX_FORMULA_DEPTH = 64  # operations nested in one another (simpleeval evaluates them recursively)
MAX_FORMULA_S = 0.25  # one evaluation's clock (a full-length formula takes about a millisecond)
_FUNCTION_NAMES = ("min", "max", "abs", "floor", "ceil", "exp", "sqrt", "log")


class FormulaError(ArithmeticError):
    """The formula has no value for these scores (a division by zero, the log of 0, ...)."""


class _Clock:
    """Each operation of one evaluation, on floats, after a look at the clock (module docstring)."""

    def __init__(self) -> None:
        self._deadline = time.monotonic() + MAX_FORMULA_S

    def op(self, fn: Callable[..., Any]) -> Callable[..., float]:
        def bounded(*args: Any) -> float:
            if time.monotonic() > self._deadline:
                raise ArithmeticError(f"it took longer than {MAX_FORMULA_S:g} s")
            return float(fn(*(float(arg) for arg in args)))
        return bounded


def _python(formula: str) -> str:
    return formula.strip().replace("^", "**")


def _evaluator(names: Mapping[str, float]) -> SimpleEval:
    clock = _Clock()
    operators: dict[type, Any] = {ast.Add: clock.op(operator.add), ast.Sub: clock.op(operator.sub),
                                  ast.Mult: clock.op(operator.mul), ast.Div: clock.op(operator.truediv),
                                  ast.Pow: clock.op(math.pow), ast.USub: clock.op(operator.neg),
                                  ast.UAdd: clock.op(operator.pos)}
    functions = {"min": clock.op(min), "max": clock.op(max), "abs": clock.op(abs), "floor": clock.op(math.floor),
                 "ceil": clock.op(math.ceil), "exp": clock.op(math.exp), "sqrt": clock.op(math.sqrt),
                 "log": clock.op(math.log)}
    assert tuple(functions) == _FUNCTION_NAMES
    return SimpleEval(operators=operators, functions=functions, names=dict(names))


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
    known = set(grader_names) | set(_FUNCTION_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in known:
            raise SettingsError(param, f"{param} uses {node.id!r}, which is neither a grader of this multi "
                                f"grader ({', '.join(grader_names)}) nor a function ({', '.join(_FUNCTION_NAMES)})")
        if isinstance(node, ast.Constant) and not _finite(node.value):
            raise SettingsError(param, f"{param}: {str(node.value)[:40]} is not a number a float can hold")
        if isinstance(node, ast.expr) and not isinstance(node, ast.Name | ast.Constant | ast.BinOp | ast.UnaryOp |
                                                         ast.Call):
            raise SettingsError(param, f"{param}: only numbers, grader names, + - * / ^, parentheses and "
                                "function calls are allowed")
    if (depth := _depth(tree.body)) > MAX_FORMULA_DEPTH:
        raise SettingsError(param, f"{param} nests {depth} operations in one another (a + b + c nests 2); at "
                            f"most {MAX_FORMULA_DEPTH}")
    try:
        evaluate(formula, dict.fromkeys(grader_names, 0.5))
    except FormulaError:
        pass  # e.g. log(a - 0.5) or 2 ^ (a * 1e6): it has a value for other scores


def _finite(value: object) -> bool:
    try:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:
        return False


def _depth(node: ast.AST) -> int:
    """How many operations nest in one another below `node`, iteratively (its own stack is bounded)."""
    deepest, stack = 0, [(node, 0)]
    while stack:
        current, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(current) if isinstance(child, ast.expr))
    return deepest


def evaluate(formula: str, scores: Mapping[str, float]) -> float:
    """The formula's value for these scores; FormulaError when it has none."""
    try:
        value = _evaluator(scores).eval(_python(formula))
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except (ArithmeticError, ValueError, TypeError, RecursionError, SyntaxError, InvalidExpression) as err:
        # a division by zero, log(0), an overflow, min() of nothing, a literal too long for a float, ...
        raise FormulaError(f"calculate_output has no value for these scores: {err}") from None
    if not math.isfinite(number):
        raise FormulaError(f"calculate_output gave {value!r:.100}, not a finite number")
    return number
