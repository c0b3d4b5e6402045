"""The sizes a structured-output spec may have: checked when a spec is made, before any library sees it.

A JSON schema is a program for the grammar library: `{"minItems": 167966261}` asks llguidance 1.7 (the
version vLLM 0.32 pins) for a grammar of 168 million array items, and it allocates until the kernel
ends the process. So every size a schema controls is bounded here, in pure Python, before llguidance
runs: a spec over a limit cannot be built (`StructuredOutput.json_schema` raises), so no gateway,
offline `LLM` or engine ever compiles one. What these bounds miss, the guarded compile
(`coserve.structured`) catches with a memory and time budget.

The limits (docs/limits.md lists them with every other size a client controls) follow what real
clients send. OpenAI's own structured outputs allow 5,000 properties, 10 levels of object nesting and
1,000 enum values per schema; the rest are set from llguidance's measured costs (coserve/bench/hostile.py),
each well above what a model's output could use:

| what | limit | why |
|---|---|---|
| schema text | 256 KiB | |
| JSON nesting of the schema | 64 levels | serde's own limit is 128 |
| subschemas nested in subschemas | 32 levels | OpenAI: 10 levels of objects |
| subschemas in all | 10,000 | |
| properties in all / of one object | 5,000 / 1,000 | optional properties cost n^2 to compile |
| `enum` values in all | 1,000 | OpenAI's |
| `prefixItems` of one array | 1,000 | |
| `minItems`, `maxItems`, `minContains`, `maxContains` | 10,000 each, 20,000 summed | llguidance writes items out |
| `minLength`, `maxLength` | 100,000 | |
| `minProperties`, `maxProperties` | 5,000 | no object may have more properties |
| a `pattern` (or `patternProperties` key) written out | 10,000 atoms | `(a{100}){100}` is 10,000 |
| a Lark grammar | 1 MiB | |
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

Path = tuple[str | int, ...]

MAX_SCHEMA_BYTES = 256 * 1024
MAX_LARK_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_NESTING = 32
MAX_SUBSCHEMAS = 10_000
MAX_PROPERTIES = 5_000
MAX_OBJECT_PROPERTIES = 1_000
MAX_ENUM_VALUES = 1_000
MAX_PREFIX_ITEMS = 1_000
MAX_ITEMS = 10_000
MAX_ITEMS_TOTAL = 20_000
MAX_LENGTH = 100_000
MAX_PATTERN_SIZE = 10_000

# Keyword -> its bound. The item counts are also summed over the schema (MAX_ITEMS_TOTAL).
_ITEM_COUNTS = ("minItems", "maxItems", "minContains", "maxContains")
_COUNT_LIMITS: dict[str, int] = {
    **dict.fromkeys(_ITEM_COUNTS, MAX_ITEMS),
    **dict.fromkeys(("minLength", "maxLength"), MAX_LENGTH),
    **dict.fromkeys(("minProperties", "maxProperties"), MAX_PROPERTIES),
}
# Where a schema holds subschemas: name -> subschema; a list of them; one of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
                "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema")


@dataclass(frozen=True, slots=True)
class Violation:
    """A size over its limit: where in the schema (`("properties", "a", "maxItems")`), and what."""

    path: Path
    message: str


@dataclass(slots=True)
class _Totals:
    subschemas: int = 0
    properties: int = 0
    enum_values: int = 0
    items: float = 0


def schema_violation(schema: Any) -> Violation | None:
    """The first size of `schema` (a parsed JSON schema) over its limit, or None."""
    return schemas_violation([schema], prefix=False)


def schemas_violation(schemas: Sequence[Any], prefix: bool = True) -> Violation | None:
    """The same for several schemas compiled into one grammar (a forced tool call embeds every
    function's schema): the totals count them all. `prefix`: paths start with the schema's index."""
    totals = _Totals()
    for index, schema in enumerate(schemas):
        root: Path = (index,) if prefix else ()
        for path, node, depth in _subschemas(schema, root):
            found = _node_violation(node, path, depth, totals)
            if found is not None:
                return found
        too_deep = _json_depth_violation(schema, root)  # in what is not a subschema (`enum`, `const`)
        if too_deep is not None:
            return too_deep
    return None


def lark_violation(grammar: str) -> Violation | None:
    """A Lark grammar over its size limit, or None."""
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > MAX_LARK_BYTES:
        return Violation((), f"the grammar is {size} bytes; the limit is {MAX_LARK_BYTES}")
    return None


def schema_text_violation(text: str) -> Violation | None:
    """A schema's JSON text over its size limit, or None."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        return Violation((), f"the schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}")
    return None


def _json_depth_violation(value: Any, root: Path) -> Violation | None:
    """The JSON value nested deeper than MAX_JSON_DEPTH (an `enum` value counts as much as a
    subschema: the encoder and the grammar library both recurse), or None. Iterative."""
    stack: list[tuple[Any, Path]] = [(value, root)]
    while stack:
        node, path = stack.pop()
        if len(path) - len(root) > MAX_JSON_DEPTH:
            return Violation(path, f"the schema is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(node, dict):
            stack.extend((child, (*path, key)) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, (*path, i)) for i, child in enumerate(node))
    return None


def _subschemas(schema: Any, root: Path) -> Iterator[tuple[Path, dict[str, Any], int]]:
    """Every subschema (a JSON object) with its path and nesting level (the root is 1), depth first."""
    stack: list[tuple[Any, Path, int]] = [(schema, root, 1)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, dict):
            continue  # `true`/`false` schemas, or what llguidance will refuse
        yield path, node, depth
        children: list[tuple[Any, Path]] = []
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(child, (*path, key, name)) for name, child in node[key].items()]
        for key in (*_SCHEMA_LISTS, "items"):
            if isinstance(node.get(key), list):
                children += [(child, (*path, key, i)) for i, child in enumerate(node[key])]
        children += [(node[key], (*path, key)) for key in _SCHEMA_ONES if isinstance(node.get(key), dict)]
        stack.extend((child, child_path, depth + 1) for child, child_path in reversed(children))


def _node_violation(node: dict[str, Any], path: Path, depth: int, totals: _Totals) -> Violation | None:
    if depth > MAX_NESTING:
        return Violation(path, f"subschemas are nested more than {MAX_NESTING} levels deep")
    totals.subschemas += 1
    if totals.subschemas > MAX_SUBSCHEMAS:
        return Violation(path, f"the schema has more than {MAX_SUBSCHEMAS} subschemas")
    for check in (_count_violation, _collection_violation, _pattern_violation):
        found = check(node, path, totals)
        if found is not None:
            return found
    return None


def _count_violation(node: dict[str, Any], path: Path, totals: _Totals) -> Violation | None:
    for key, limit in _COUNT_LIMITS.items():
        value = node.get(key)
        if not _is_number(value):
            continue  # llguidance judges what is not a count
        if value > limit:
            return Violation((*path, key), f"'{key}' is {_show(value)}; the limit is {limit}")
        if key in _ITEM_COUNTS and value > 0:
            totals.items += value
            if totals.items > MAX_ITEMS_TOTAL:
                return Violation((*path, key), f"the schema's minItems, maxItems, minContains and maxContains "
                                               f"add up to more than {MAX_ITEMS_TOTAL}")
    return None


def _collection_violation(node: dict[str, Any], path: Path, totals: _Totals) -> Violation | None:
    properties = node.get("properties")
    if isinstance(properties, dict):
        if len(properties) > MAX_OBJECT_PROPERTIES:
            return Violation((*path, "properties"), f"an object has {len(properties)} properties; the limit "
                                                    f"is {MAX_OBJECT_PROPERTIES}")
        totals.properties += len(properties)
        if totals.properties > MAX_PROPERTIES:
            return Violation((*path, "properties"), f"the schema has more than {MAX_PROPERTIES} properties")
    prefix = node.get("prefixItems")
    if isinstance(prefix, list) and len(prefix) > MAX_PREFIX_ITEMS:
        return Violation((*path, "prefixItems"), f"'prefixItems' has {len(prefix)} schemas; the limit is "
                                                 f"{MAX_PREFIX_ITEMS}")
    enum = node.get("enum")
    if isinstance(enum, list):
        totals.enum_values += len(enum)
        if totals.enum_values > MAX_ENUM_VALUES:
            return Violation((*path, "enum"), f"the schema has more than {MAX_ENUM_VALUES} enum values")
    return None


def _pattern_violation(node: dict[str, Any], path: Path, totals: _Totals) -> Violation | None:
    patterns: list[tuple[Path, Any]] = [((*path, "pattern"), node.get("pattern"))]
    if isinstance(node.get("patternProperties"), dict):
        patterns += [((*path, "patternProperties", key), key) for key in node["patternProperties"]]
    for where, pattern in patterns:
        if isinstance(pattern, str) and pattern_size(pattern, MAX_PATTERN_SIZE) > MAX_PATTERN_SIZE:
            return Violation(where, f"the pattern, its counted repetitions written out, is more than "
                                    f"{MAX_PATTERN_SIZE} atoms (e.g. '(a{{100}}){{100}}' is 10000)")
    return None


def pattern_size(pattern: str, cap: int = MAX_PATTERN_SIZE) -> int:
    """How many atoms a regular expression makes with each counted repetition written out: `a{3}` is 3,
    `(ab){2}c` is 5, `(a{10}){10}` is 100; a class, an escape or `.` is one atom, `*`, `+` and `?` add
    none. Saturates just above `cap` (the answer is min(size, cap + 1)). Not a validator: what does
    not parse is left for the grammar library to refuse."""
    frames = [[0, 0]]  # per open group: [size so far, size of its last atom]
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        frame = frames[-1]
        if char == "(":
            frames.append([0, 0])
            i = _group_body_start(pattern, i)
            continue
        if char == ")" and len(frames) > 1:
            size = frames.pop()[0]
            _atom(frames[-1], size, cap)
        elif char == "|":
            frame[1] = 0
        elif char == "{" and (repeat := _quantifier(pattern, i)) is not None:
            count, i = repeat
            extra = min(frame[1] * (count - 1), cap + 1) if count > 0 else -frame[1]
            frame[0] = min(frame[0] + extra, cap + 1)
            frame[1] = min(frame[1] * count, cap + 1)
            continue
        elif char not in "*+?^$":
            i = _atom_end(pattern, i)
            _atom(frame, 1, cap)
            continue
        i += 1
    return min(sum(f[0] for f in frames), cap + 1)


def _atom(frame: list[int], size: int, cap: int) -> None:
    frame[0] = min(frame[0] + size, cap + 1)
    frame[1] = size


def _group_body_start(pattern: str, i: int) -> int:
    """Past `(` and a group's `?:`, `?=`, `?!`, `?<=`, `?<!`, `?<name>` or `?P<name>` prefix."""
    i += 1
    if i < len(pattern) and pattern[i] == "?":
        ends = [pattern.find(c, i) for c in ":=!>)"]
        found = [e for e in ends if e >= 0]
        if found:
            end = min(found)
            return end if pattern[end] == ")" else end + 1
    return i


def _atom_end(pattern: str, i: int) -> int:
    """Past one atom starting at `i`: a character, an escape (`\\d`, `\\p{L}`, `\\x{41}`) or a class."""
    if pattern[i] == "\\":
        if i + 2 < len(pattern) and pattern[i + 1] in "pPxu" and pattern[i + 2] == "{":
            close = pattern.find("}", i + 2)
            return len(pattern) if close < 0 else close + 1
        return i + 2
    if pattern[i] == "[":
        return _class_end(pattern, i)
    return i + 1


def _class_end(pattern: str, i: int) -> int:
    """Past a character class `[...]` at `i` (escapes, a leading `]` or `^]`, nested classes)."""
    i += 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):
        i += 1  # a leading `]` is a literal
    depth = 1
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(pattern)


def _quantifier(pattern: str, i: int) -> tuple[int, int] | None:
    """`{n}`, `{n,}` or `{n,m}` at `i`: (the larger count, the index past it); None if it is a literal."""
    close = pattern.find("}", i)
    if close < 0:
        return None
    body = pattern[i + 1:close].replace(" ", "")
    low, comma, high = body.partition(",")
    if not low.isdigit() or (high and not high.isdigit()) or (not comma and high):
        return None
    return max(_count(low), _count(high) if high else 0), close + 1


def _count(digits: str) -> int:
    """A quantifier's count, saturated at 10**12 (more than any cap; a huge one costs nothing)."""
    return int(digits) if len(digits.lstrip("0")) <= 12 else 10**12


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


def _show(value: float) -> str:
    return json.dumps(value) if isinstance(value, float) and math.isfinite(value) else str(value)
