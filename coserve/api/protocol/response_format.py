"""`response_format` of `POST /v1/chat/completions`: structured output on the wire.

Reference: https://platform.openai.com/docs/api-reference/chat/create#chat-create-response_format.
`{"type": "text"}` (the default), `{"type": "json_object"}` and `{"type": "json_schema", "json_schema":
{"name", "description", "schema", "strict"}}` are accepted. The schema's sizes are bounded here
(`contract.schema_limits`: a 400 naming the limit and the path inside the schema, e.g.
`response_format.json_schema.schema.properties.a.maxItems`); whether the grammar library can enforce it
is checked at admission, off the event loop and under a budget (`frontend.intake`), before anything is
queued.

`strict` is accepted either way and changes nothing: coserve enforces every schema it accepts, token by
token (OpenAI's `strict: false` is best effort; coserve's is never weaker).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from coserve.api.protocol.base import nested_param, param_error
from coserve.api.protocol.strict import RequestModel
from coserve.contract.structured_output import StructuredOutput, StructuredOutputError


class JsonSchemaFormat(RequestModel):
    """The `json_schema` object of a `json_schema` response format."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """What the assistant's content must be: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise param_error("json_schema", f"'json_schema' is only allowed with type 'json_schema', "
                                                 f"not '{self.type}'")
            return self
        if self.json_schema is None:
            raise param_error("json_schema", "type 'json_schema' needs a 'json_schema' object")
        if self.json_schema.schema_ is None:
            raise param_error("json_schema.schema", "type 'json_schema' needs 'json_schema.schema'")
        try:
            self.to_structured_output()
        except StructuredOutputError as error:
            raise param_error(nested_param("json_schema.schema", error.path), str(error)) from None
        return self

    def to_structured_output(self) -> StructuredOutput | None:
        """The engine's spec (None for plain text)."""
        if self.type == "json_object":
            return StructuredOutput.json_object()
        if self.type == "json_schema":
            schema = None if self.json_schema is None else self.json_schema.schema_
            assert schema is not None  # `_check` refuses a 'json_schema' format without a schema
            return StructuredOutput.json_schema(schema)
        return None
