"""Every module of `coserve` stays readable in one sitting: at most 400 lines a file and 60 lines a function
(docstrings included). A file that grows past it is split along its concerns (a method's batch source, a
job's slot, a planner's request book), never by line count."""

from __future__ import annotations

import ast
from pathlib import Path

import coserve

PACKAGE = Path(coserve.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_no_file_is_over_400_lines() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"] = lines
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"
