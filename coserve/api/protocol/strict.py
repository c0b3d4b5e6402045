"""Request models: strict JSON types, known fields only, and text that is valid Unicode.

OpenAI refuses `"stream": "yes"`, `"max_tokens": "4"` or `true`, and `"n": 2.0` with 400 `invalid_type`
naming the param; pydantic's default (lax) mode would take them as `True`, `4`, `1` and `2`.
`RequestModel` validates in strict mode: booleans must be JSON booleans, integers JSON integers (not
booleans, strings or decimal numbers), numbers JSON numbers (integers are numbers), strings JSON strings.

An unknown field, at the top level or nested (`max_token`, vLLM's `guided_json`, a key inside
`messages[0]` or `response_format.json_schema`), is a 400 with OpenAI's message `Unrecognized request
argument supplied: <path>`, `param` its path. A model's `PARAMS` table (`param_support`) names the
OpenAI fields it knows without a field of its own: those are refused unless their value means "not
used", and otherwise accepted and dropped. Inside `lenient_params()` (`coserve serve --lenient-params`)
unknown fields are dropped with a log line instead, as coserve did before.

JSON may carry text that no UTF-8 string can hold: a lone surrogate escape (`"\\ud800"`). Python's
parser keeps it, and it would fail later and far away (the tokenizer, SQLite, the JSON encoder of the
reply). `RequestBody` refuses such a body at once, naming the param that holds it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from coserve.api.protocol.base import OpenAIBaseModel, format_param, unknown_param_error
from coserve.api.protocol.param_support import EndpointParams

logger = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")
_LENIENT: ContextVar[bool] = ContextVar("coserve_lenient_params", default=False)
# (model, unknown field names) pairs already logged in lenient mode: clients resend the same extras on
# every request, and one line per combination is enough to notice them.
_LOGGED_EXTRAS: set[tuple[str, frozenset[str]]] = set()
_MAX_LOGGED_EXTRAS = 1024


@contextmanager
def lenient_params() -> Iterator[None]:
    """Within the block (one request, in the gateway), unknown fields are dropped with a log line."""
    token = _LENIENT.set(True)
    try:
        yield
    finally:
        _LENIENT.reset(token)


def _log_ignored(where: str, names: Iterable[str]) -> None:
    key = (where, frozenset(names))
    if key not in _LOGGED_EXTRAS and len(_LOGGED_EXTRAS) < _MAX_LOGGED_EXTRAS:
        _LOGGED_EXTRAS.add(key)
        logger.warning("%s: ignoring unsupported fields %s", where, sorted(key[1]))


def refuse_unknown(where: str, param: str | None) -> None:
    """For a free-form JSON value (tools, graders) checked outside pydantic: `param`, the path of an
    unknown key relative to the field being validated (None: there is none), is refused with OpenAI's
    400, or logged and ignored in lenient mode. Call it inside a validator."""
    if param is None:
        return
    if _LENIENT.get():
        _log_ignored(where, [param])
        return
    raise unknown_param_error(param)


class RequestModel(OpenAIBaseModel):
    """Base of every model a client sends (bodies and their nested objects): strict JSON types, and an
    unknown field is a 400 (module docstring). `PARAMS`: the model's `param_support` table, if any."""

    model_config = ConfigDict(strict=True, extra="forbid")

    PARAMS: ClassVar[EndpointParams | None] = None

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if cls.PARAMS is not None:
            cls.PARAMS.validate(data)  # a refused parameter, or a value a partly supported one does not take
            data = {key: value for key, value in data.items()
                    if key in cls.model_fields or key not in cls.PARAMS.params}  # accepted and not used
        if _LENIENT.get():
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [key for key in data if key not in known]
            if unknown:
                _log_ignored(cls.__name__, unknown)
                data = {key: value for key, value in data.items() if key in known}
        return data


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
