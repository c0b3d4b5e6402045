"""The JSON of training files, read one strict way: at upload, once.

The gateway checks an upload with it (`api/protocol/files.py`: a 400 naming the line) and keeps what it read
(`training_rows.ParsedTrainingFile`), which later steps read instead of the bytes; the job manager reads with
it only a file stored before the server kept its parsed rows (`jobs/preparation.py`), so a file either side
accepts, the other reads the same: lines split on "\\n" only (not on the other line breaks
`str.splitlines` knows, such as U+2028 inside a string), a byte-order mark allowed on the first line, blank
lines skipped but counted.

Refused, each with a phrase saying why (`JsonTextError`, `RowError` adding the 1-based line):

* a line longer than `MAX_ROW_BYTES`;
* bytes that are not UTF-8 (an encoded surrogate, `b"\\xed\\xa0\\x80"`, included);
* text that is not JSON, and the constants Python's parser accepts but JSON has not (`NaN`, `Infinity`);
* an integer longer than Python converts (4,300 digits);
* nesting deeper than `MAX_JSON_DEPTH` objects and arrays: tokenizers, templates and graders recurse
  over what a row holds, so its depth is bounded well inside the interpreter's recursion limit;
* a lone surrogate in any string or key: `"\\ud800"` is valid JSON syntax that decodes to a code point
  no UTF-8 text holds, on which the tokenizer raises (a surrogate pair, `"\\ud83d\\ude00"`, decodes to
  one character and is fine).

The depth and surrogate walks run only when the text could need them (more brackets than the bound, a
`\\uD8..`-`\\uDF..` escape), so ordinary rows pay for `json.loads` alone.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from typing import Any

MAX_JSON_DEPTH = 100  # objects and arrays nested in one row (a tool's schema may nest 64: schema_limits)
# The bytes of one row (a line). json.loads holds the GIL for a whole line (0.3 s for 5 MB of small objects
# on a busy 2-core machine), so the line, not the file, bounds the gateway's pause; a row's text is cut to
# the model's context anyway (500k tokens of text is about 2 MiB).
MAX_ROW_BYTES = 2 * 1024 * 1024
_MAX_PATH_KEY = 40  # a key shown in an error's path is cut to this many characters
# Any escape of a code point in U+D800-U+DFFF: a walk then looks for a lone one among the decoded strings.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Path = tuple[Any, str | int] | None  # (parent path, key or index); None: the row itself


class JsonTextError(ValueError):
    """A JSON text a training file may not hold; the message is a phrase (`not valid JSON (...)`)."""


class RowError(ValueError):
    """A line of a JSONL training file that is refused: `line` (1-based) and `reason` (a phrase)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def _refuse_constant(name: str) -> Any:
    raise JsonTextError(f"not valid JSON ({name} is not a JSON value)")


def loads_strict(text: str) -> Any:
    """`json.loads(text)`, refusing what a training file must not hold (module docstring).

    Raises:
        JsonTextError: why, as a phrase naming the place of a lone surrogate (`input.messages[0].content`).
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # the C decoder's own bound (about 1,000 levels), reached before the walk's
        raise JsonTextError(f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays") from None
    except json.JSONDecodeError as exc:
        raise JsonTextError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except JsonTextError:
        raise
    except ValueError:  # json.loads raises nothing else; this is int's conversion limit
        raise JsonTextError(f"a number with more than {sys.get_int_max_str_digits()} digits") from None
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if deep or surrogates:
        _walk(value, surrogates)
    return value


def _walk(value: Any, surrogates: bool) -> None:
    """Refuse nesting past `MAX_JSON_DEPTH` and (when `surrogates`) lone surrogates, first in text order."""
    stack: list[tuple[Any, Path, int]] = [(value, None, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if surrogates and _SURROGATE.search(item):
                _lone_surrogate(item, path)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise JsonTextError(f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays")
        children: list[tuple[Any, Path, int]] = []
        if isinstance(item, dict):
            for key, child in item.items():
                if surrogates and _SURROGATE.search(key):
                    _lone_surrogate(key, path, key=True)
                children.append((child, (path, key), depth + 1))
        else:
            children = [(child, (path, index), depth + 1) for index, child in enumerate(item)]
        stack.extend(reversed(children))


def _lone_surrogate(text: str, path: Path, key: bool = False) -> None:
    match = _SURROGATE.search(text)
    assert match is not None
    where = f"a key of {_path_text(path)}" if key else _path_text(path)
    raise JsonTextError(f"a lone surrogate (\\u{ord(match.group()):04x}) in {where}: text must be valid Unicode "
                        "(a JSON \\u escape of U+D800-U+DFFF must be half of a surrogate pair)")


def _path_text(path: Path) -> str:
    """`input.messages[0].content` (`the row` for the row itself)."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        if isinstance(key, int):
            parts.append(f"[{key}]")
        elif _IDENTIFIER.fullmatch(key) and len(key) <= _MAX_PATH_KEY:
            parts.append(f".{key}")
        else:
            parts.append(f"[{ascii(key[:_MAX_PATH_KEY])}]")
    text = "".join(reversed(parts)).lstrip(".")
    return text or "the row"


def jsonl_rows(data: bytes) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed row) of every non-blank line, in order (module docstring: the rules).

    Raises:
        RowError: the first line that is too long, not UTF-8 or not strict JSON.
    """
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if len(raw) > MAX_ROW_BYTES:
            raise RowError(line_no, f"{len(raw)} bytes long; a row holds at most {MAX_ROW_BYTES} bytes")
        try:
            # utf-8-sig on the first line: editors on Windows prepend a byte-order mark.
            line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise RowError(line_no, f"not valid UTF-8 (byte {exc.object[exc.start]:#04x} at byte "
                                    f"{exc.start + 1} of the line)") from None
        if not line.strip():
            continue
        try:
            yield line_no, loads_strict(line)
        except JsonTextError as err:
            raise RowError(line_no, str(err)) from None


def read_rows(data: bytes) -> list[Any]:
    """Every row of a JSONL training file (`jsonl_rows`, without the line numbers).

    Raises:
        RowError: as `jsonl_rows`.
    """
    return [row for _, row in jsonl_rows(data)]
