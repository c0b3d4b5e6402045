"""Shared protocol pieces: the base models, OpenAI's error body, usage, and validation-error mapping.

Every request and response model of the gateway derives from `OpenAIBaseModel`; request models derive
from `RequestModel` (strict JSON types: `"stream": "yes"` or `"max_tokens": "4"` are refused, as OpenAI
refuses them, and so are unknown fields) and whole request bodies from `RequestBody` (also refused: text
that is not valid Unicode).
Validation failures never reach users in FastAPI's 422 shape: `error_from_validation` turns a pydantic
`ValidationError` into a `ProtocolError` (400 `invalid_request_error` naming the offending param), and
`ProtocolError` renders as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
Reference: https://platform.openai.com/docs/guides/error-codes
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

# The error type of an unknown field found outside pydantic's own check (`extra_forbidden`): in a value
# kept as free-form JSON (tools, tool calls, graders). Raise it with `unknown_param_error`.
UNKNOWN_PARAMETER = "unknown_parameter"

ModelT = TypeVar("ModelT", bound=BaseModel)


class OpenAIBaseModel(BaseModel):
    """Base of every protocol model. Responses keep extra fields they are given; request models
    (`coserve.api.protocol.strict.RequestModel`) refuse unknown ones."""

    model_config = ConfigDict(extra="allow")


def now() -> int:
    """Unix time in whole seconds, the unit of every `created`/`created_at` field."""
    return int(time.time())


class ErrorBody(OpenAIBaseModel):
    """The inner object of an OpenAI error: all four keys are always present (param/code may be null)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body `{"error": {...}}`, also sent as an SSE data event when a stream fails."""

    error: ErrorBody


class UsageInfo(OpenAIBaseModel):
    """Token usage of one request (OpenAI `CompletionUsage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ProtocolError(Exception):
    """A failure to report to the client as an OpenAI error body with an HTTP status.

    Raised by validation helpers and by the serving layer; the router layer renders it with
    `to_response()` and `status`. `code` is an OpenAI string code (never the HTTP status).
    """

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # sent with the response (e.g. `retry-after` on a 429)

    def to_response(self) -> ErrorResponse:
        """The JSON body to send with `self.status`."""
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    @classmethod
    def not_found(cls, message: str, *, param: str | None = None,
                  code: str | None = None) -> ProtocolError:
        """404: unknown resource, or one that belongs to another tenant (never 403, so ids don't leak)."""
        return cls(message, status=404, param=param, code=code)

    def __repr__(self) -> str:
        return (f"ProtocolError(status={self.status}, type={self.type!r}, param={self.param!r}, "
                f"code={self.code!r}, message={self.message!r})")


def param_error(param: str, message: str) -> PydanticCustomError:
    """A validation error for a cross-field rule, naming `param` explicitly.

    A model validator's error is located at the model itself, so the field travels in the error's
    context and `error_from_validation` appends it to that location. Raise it inside a validator.
    """
    # The message is a format template over the context; braces from user values would be read as fields.
    return PydanticCustomError("invalid_value", message.replace("{", "(").replace("}", ")"),
                               {"param": param})


def nested_param(param: str, path: Sequence[int | str]) -> str:
    """`param` followed by a path inside its value, in OpenAI's notation:
    `('tools[0].function.parameters', ['properties', 'a'])` -> `'tools[0].function.parameters.properties.a'`."""
    return param + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)


def unknown_param_error(param: str) -> PydanticCustomError:
    """The validation error of an unknown field found in a free-form JSON value; `param` is its path
    relative to the validated field or model (`error_from_validation` appends it to that location)."""
    return PydanticCustomError(UNKNOWN_PARAMETER, "Unrecognized request argument supplied", {"param": param})


def unknown_param_message(param: str) -> str:
    """OpenAI's words for a field it does not know."""
    return f"Unrecognized request argument supplied: {param}"


def value_error(message: str) -> PydanticCustomError:
    """A validation error for a field validator's own field (its location already names the param)."""
    return PydanticCustomError("invalid_value", message.replace("{", "(").replace("}", ")"))


# Location items that pydantic inserts for union members ('str', "literal['auto']", 'constrained-int',
# 'list[TextPart]', model class names): none of them is one of our snake_case field names.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})
_TYPE_MISMATCH = frozenset({"literal_error", "model_type", "model_attributes_type", "union_tag_invalid",
                            "is_instance_of"})


_UNKNOWN = frozenset({"extra_forbidden", UNKNOWN_PARAMETER})


def _clean_loc(loc: tuple[int | str, ...]) -> list[int | str]:
    return [p for p in loc if isinstance(p, int) or (_FIELD_NAME.fullmatch(p) and p not in _TYPE_TAGS)]


def _loc(err: Any) -> list[int | str]:
    """An error's location as field names and indexes; an unknown field keeps its own name, whatever it
    is (`maxTokens`, `str`)."""
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden" and loc:
        return [*_clean_loc(loc[:-1]), loc[-1]]
    return _clean_loc(loc)


def format_param(loc: list[int | str]) -> str | None:
    """`['messages', 0, 'role']` -> `'messages[0].role'` (OpenAI's notation); an empty path -> None."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _is_type_mismatch(err_type: str) -> bool:
    # `*_parsing`: a query parameter (always text) that does not read as the type, e.g. `limit=abc`.
    return err_type.endswith(("_type", "_parsing")) or err_type in _TYPE_MISMATCH


def _rank(err_type: str) -> int:
    # A value error means the input had the right shape; a wrong tag (`type: "image_url"`) explains
    # the fields missing after it better than the missing fields do.
    # An unknown field comes last: in a union, the branch whose tag the input does not match (an image
    # part's `image_url` key) is better explained by its tag.
    if err_type in _UNKNOWN:
        return 3
    if err_type == "missing":
        return 2
    return 1 if _is_type_mismatch(err_type) else 0


def _pick_error(errors: list[Any]) -> Any:
    """The most telling error of a union failure: the same top-level field as the first error, the
    deepest location (the branch that matched the input's shape), then by `_rank`."""
    top = _loc(errors[0])[:1]
    same = [e for e in errors if _loc(e)[:1] == top]
    return min(same, key=lambda e: (-len(_loc(e)), _rank(e["type"])))


# What each pydantic type error expected, in JSON's terms (OpenAI's wording: "expected an integer").
_EXPECTED = {"int_type": "an integer", "bool_type": "a boolean", "float_type": "a number",
             "string_type": "a string", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object", "int_parsing": "an integer",
             "float_parsing": "a number", "bool_parsing": "a boolean"}


def json_type_name(value: Any) -> str:
    """What a parsed JSON value is, as OpenAI names it in "but got ... instead"."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    # A multipart form's file part (Starlette's UploadFile) where a plain field was expected.
    return "a file" if hasattr(value, "filename") else "a value of another kind"


def _expected(err: Any) -> str:
    """What one error (one branch of a union) wanted: a JSON type, or a literal's values ('auto')."""
    if err["type"] == "literal_error":
        return str((err.get("ctx") or {}).get("expected", ""))
    return _EXPECTED.get(err["type"], "")


def _type_error(param: str, err: Any, errors: list[Any]) -> ProtocolError | None:
    """OpenAI's `Invalid type for 'max_tokens': expected an integer, but got a string instead.`, listing
    what every branch of a union expected; None when no branch names a JSON type (a pure literal
    mismatch such as an unknown `role` stays an `invalid_value`)."""
    loc = _loc(err)
    here = [other for other in errors if _loc(other) == loc]
    if not any(other["type"] in _EXPECTED for other in here):
        return None
    wanted = " or ".join(dict.fromkeys(e for e in map(_expected, here) if e))
    return ProtocolError(f"Invalid type for '{param}': expected {wanted}, but got "
                         f"{json_type_name(err.get('input'))} instead.", param=param, code="invalid_type")


def _body_error(err: Any) -> ProtocolError:
    """An error about the body as a whole: empty, not JSON, or JSON that is not an object."""
    if err["type"] == "missing":
        return ProtocolError("The request body is empty; expected a JSON object.", code="invalid_json")
    body = err.get("input")
    if isinstance(body, bytes):  # FastAPI parses JSON only when the content type says JSON
        return ProtocolError("The request body must be a JSON object sent with 'Content-Type: "
                             "application/json'.", code="invalid_json")
    return ProtocolError(f"The request body must be a JSON object, but got {json_type_name(body)} "
                         "instead.", code="invalid_type")


def error_from_validation(exc: ValidationError) -> ProtocolError:
    """Turn a pydantic `ValidationError` into a 400 `invalid_request_error` naming the offending param.

    Codes follow OpenAI's: `missing_required_parameter`, `invalid_type`, `invalid_value`,
    `unknown_parameter` (OpenAI's message: `Unrecognized request argument supplied: max_token`; `param` the
    field's path), and `invalid_json` for a body that is empty or not JSON.
    """
    errors = exc.errors(include_url=False)
    if not errors:
        return ProtocolError("Invalid request.", code="invalid_value")
    err = _pick_error(errors)
    ctx = err.get("ctx") or {}
    loc = _loc(err)
    if isinstance(ctx.get("param"), str):
        # A model validator's error sits at the model's own location; its param is relative to it.
        loc.append(ctx["param"])
    param = format_param(loc)
    msg = str(err["msg"]).rstrip(".")
    if err["type"] == "json_invalid":
        return ProtocolError(f"The request body is not valid JSON: {msg}.", code="invalid_json")
    if err["type"] in _UNKNOWN and param is not None:
        return ProtocolError(unknown_param_message(param), param=param, code="unknown_parameter")
    if param is None and (err["type"] == "missing" or _is_type_mismatch(err["type"])):
        return _body_error(err)
    if err["type"] == "missing":
        return ProtocolError(f"Missing required parameter: '{param}'.", param=param,
                             code="missing_required_parameter")
    if err["type"] == "string_unicode":
        return invalid_unicode_error(param)
    if err["type"] == "unsupported":  # `param_support`: the message is whole, the code its own
        # A nested table's message names the field as its model knows it ('audio'): name its path.
        message = str(err["msg"]).replace(f"'{ctx.get('param')}'", f"'{param}'", 1)
        return ProtocolError(message, param=param, code=str(ctx.get("code") or "invalid_value"))
    if param is not None and _is_type_mismatch(err["type"]):
        typed = _type_error(param, err, errors)
        if typed is not None:
            return typed
    code = "invalid_type" if _is_type_mismatch(err["type"]) and err["type"] != "literal_error" \
        else "invalid_value"
    where = f"Invalid '{param}'" if param else "Invalid request body"
    return ProtocolError(f"{where}: {msg}.", param=param, code=code)


def invalid_unicode_message(param: str | None) -> str:
    """What to tell a client whose text holds a lone surrogate (`"\\ud800"` in its JSON)."""
    where = f"Invalid '{param}': the text" if param else "The request body"
    return (f"{where} is not valid Unicode: it contains a lone surrogate (a JSON escape between "
            "\\ud800 and \\udfff without its pair), which no UTF-8 text can hold.")


def invalid_unicode_error(param: str | None) -> ProtocolError:
    """400 `invalid_value` naming the param whose text is not valid Unicode."""
    return ProtocolError(invalid_unicode_message(param), param=param, code="invalid_value")


def validate_request(model: type[ModelT], data: Any) -> ModelT:
    """`model.model_validate(data)`, raising `ProtocolError` (400) instead of `ValidationError`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error_from_validation(exc) from None
