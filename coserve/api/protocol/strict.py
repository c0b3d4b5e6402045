"""Request models: strict JSON types and text that is valid Unicode.

OpenAI refuses `"stream": "yes"`, `"max_tokens": "4"` or `true`, and `"n": 2.0` with 400 `invalid_type`
naming the param; pydantic's default (lax) mode would take them as `True`, `4`, `1` and `2`.
`RequestModel` validates in strict mode: booleans must be JSON booleans, integers JSON integers (not
booleans, strings or decimal numbers), numbers JSON numbers (integers are numbers), strings JSON strings.

JSON may carry text that no UTF-8 string can hold: a lone surrogate escape (`"\\ud800"`). Python's
parser keeps it, and it would fail later and far away (the tokenizer, SQLite, the JSON encoder of the
reply). `RequestBody` refuses such a body at once, naming the param that holds it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from coserve.api.protocol.base import OpenAIBaseModel, format_param

_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestModel(OpenAIBaseModel):
    """Base of every model a client sends (bodies and their nested objects): strict JSON types."""

    model_config = ConfigDict(strict=True)


class RequestBody(RequestModel):
    """Base of a whole request body: also refuses text that is not valid Unicode, anywhere in it."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        where = find_invalid_text(data)
        if where is not None:
            # `string_unicode` is pydantic's own type for this; the gateway words it for the client.
            raise PydanticCustomError("string_unicode", "the text is not valid Unicode",
                                      {"param": format_param(where) or ""})
        return data


def find_invalid_text(value: Any) -> list[int | str] | None:
    """The path (`['messages', 0, 'content']`) of the first string or object key in a parsed JSON
    value that holds a lone surrogate; None when all of its text is valid Unicode."""
    try:
        # The common case at C speed (a 4 MB body of 100k messages: ~20 ms, where the walk below takes
        # ~240 ms): UTF-8 can encode the whole value, so no string in it holds a surrogate.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass  # there is one: find where
    except (TypeError, ValueError):
        pass  # not plain JSON (a test's Python objects): walk it
    stack: list[tuple[Any, list[int | str]]] = [(value, [])]
    while stack:  # iterative: the depth of a client's JSON is the client's choice
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            if any(isinstance(key, str) and not key.isascii() and _SURROGATE.search(key) for key in item):
                return path
            stack.extend((child, [*path, key]) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, [*path, index]) for index, child in reversed(list(enumerate(item))))
    return None
