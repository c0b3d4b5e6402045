"""The text of a forced reply in one family's format, which `call_grammar` turns into a grammar.

A forced reply is `before`, one to `max_calls` calls joined by `separator`, then `after`; each call is
`call_open` + `{"name": NAME, "<arguments_key>": ARGUMENTS}` + `call_close`, its JSON in the fixed
layout the templates' `tojson` writes (`structured_output.JSON_LAYOUT`).
"""

from __future__ import annotations

from dataclasses import dataclass

# A bound on the calls of one reply under a grammar: an unbounded repetition lets a weak model emit
# calls until its token limit cuts the last one.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True, slots=True)
class CallLayout:
    """How one family writes forced calls (see the module doc)."""

    arguments_key: str = "arguments"
    call_open: str = ""
    call_close: str = ""
    separator: str = ""
    before: str = ""
    after: str = ""
    max_calls: int = MAX_PARALLEL_CALLS  # 1: the family's templates render one call per message
