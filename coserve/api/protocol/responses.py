"""`POST /v1/responses`: the request (`client.responses.create`, `.stream`, `.parse`).

Reference: the official client's `openai.types.responses.response_create_params`. What coserve refuses or
takes differently is `param_support.RESPONSES` (a 400 naming the parameter); the input items are
`responses_items`. A request becomes the same submission a chat request becomes: its items, the replayed
conversation of `previous_response_id` first and `instructions` as the system message, turned into chat
messages (`coserve.frontend.response_items`), its function tools into chat tools (`ToolSpec`), `text.format`
into chat's structured output.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from coserve.api.protocol.base import nested_param, param_error, unknown_param_error
from coserve.api.protocol.param_support import RESPONSES, RESPONSES_TEXT, EndpointParams
from coserve.api.protocol.response_format import JsonSchemaFormat, ResponseFormat
from coserve.api.protocol.responses_items import InputItem, check_item_types
from coserve.api.protocol.strict import RequestBody, RequestModel
from coserve.api.protocol.tools import NamedFunction, NamedToolChoice, check_tool_request
from coserve.contract.structured_output import StructuredOutput
from coserve.tools.spec import ToolSpec

MAX_TOP_LOGPROBS = 20
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values coserve honours (logprobs) or that ask for nothing it makes (no reasoning items).
_INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
# Tool types of OpenAI's hosted tools (and tool kinds other than functions): a 400 naming `tools[i].type`.
HOSTED_TOOL_TYPES = frozenset({
    "file_search", "computer", "computer_use_preview", "computer_use", "web_search", "web_search_preview",
    "web_search_2025_08_26", "web_search_preview_2025_03_11", "mcp", "code_interpreter", "image_generation",
    "local_shell", "shell", "custom", "namespace", "tool_search", "apply_patch", "programmatic_tool_calling"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# Keys of OpenAI's function tools that coserve takes only when they ask for nothing.
_TOOL_UNUSED = {"defer_loading": (None, False), "allowed_callers": (None, ["direct"]), "output_schema": (None,),
                "async": (None, False)}
MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class TextFormat(RequestModel):
    """`text.format`: `text`, `json_object`, or `json_schema` with its fields at this level (not nested
    under `json_schema` as chat's `response_format` has them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> TextFormat:
        self.as_response_format()  # chat's checks: the name, the schema and its sizes
        return self

    def as_response_format(self) -> ResponseFormat:
        """Chat's `response_format` for this format (its errors name `text.format...`)."""
        if self.type != "json_schema":
            for field in ("name", "schema_", "description", "strict"):
                if getattr(self, field) is not None:
                    name = field.rstrip("_")
                    raise param_error(name, f"'{name}' is only allowed with type 'json_schema'")
            return ResponseFormat(type=self.type)
        if self.name is None:
            raise param_error("name", "type 'json_schema' needs a 'name'")
        if self.schema_ is None:
            raise param_error("schema", "type 'json_schema' needs a 'schema'")
        data = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return ResponseFormat.model_validate({"type": "json_schema", "json_schema": data})


class TextConfig(RequestModel):
    """`text`: the output's format (`verbosity` is refused by `param_support.RESPONSES_TEXT`)."""

    PARAMS: ClassVar[EndpointParams | None] = RESPONSES_TEXT
    format: TextFormat | None = None


class FunctionToolChoice(RequestModel):
    """`{"type": "function", "name": ...}`: the reply is a call of that function."""

    type: Literal["function"]
    name: str


class StreamOptions(RequestModel):
    include_obfuscation: bool | None = None  # accepted and not used (no obfuscation padding)


class ResponseCreateRequest(RequestBody):
    """The body of `POST /v1/responses`.

    `input` is a string (one user message) or a list of items; `instructions` become the first, system,
    message (not carried over by `previous_response_id`, as OpenAI's); `store` defaults to true.
    """

    PARAMS: ClassVar[EndpointParams | None] = RESPONSES

    model: str
    input: Annotated[str, Field(max_length=4 * 2**20)] | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    store: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # --- coserve extension (chat's `seed`; send it with `extra_body=`) ---
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    _spec: ToolSpec | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _screen_items_and_tools(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_item_types(data.get("input"))
            _screen_tools(data.get("tools"))
            if isinstance(data.get("include"), list):
                for index, value in enumerate(data["include"]):
                    if isinstance(value, str) and value not in _INCLUDES:
                        raise param_error(f"include[{index}]", f"'{value}' asks for the output of a hosted tool or "
                                                               "an image, which this server does not make")
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponseCreateRequest:
        self._spec = _responses_tool_spec(self.chat_tools(), self.tool_choice, self.parallel_tool_calls)
        if self.stream_options is not None and not self.stream:
            raise param_error("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if self.background and self.store is False:
            raise param_error("background", "a background response is stored: 'background' needs 'store' "
                                            "true")
        return self

    @property
    def stores(self) -> bool:
        """Whether the response is stored (`store` defaults to true)."""
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's shape (`{"type": "function", "function": {...}}`); none for an empty
        list (the Agents SDK sends `tools: []` once its tools are disabled)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {k: v for k, v in tool.items() if k in _TOOL_KEYS - {"type"}
                                                  and v is not None}}
                for tool in self.tools]

    def tool_spec(self) -> ToolSpec | None:
        """The tools the model is given and how it must use them (None without `tools`), checked when the
        request was validated."""
        return self._spec

    def text_format(self) -> StructuredOutput | None:
        """The structured output `text.format` asks for (None: plain text, or a `tool_choice` that forces
        calls: the reply is calls then, no text the format could apply to; the Agents SDK sends both)."""
        if self.text is None or self.text.format is None or (self._spec is not None and self._spec.constrained):
            return None
        return self.text.format.as_response_format().to_structured_output()


def _responses_tool_spec(tools: list[dict[str, Any]] | None, choice: str | FunctionToolChoice | None,
                         parallel: bool | None) -> ToolSpec | None:
    """Chat's `check_tool_request`, its errors' params in Responses' terms (`tools[i].parameters`, not
    `tools[i].function.parameters`: Responses' tools have no `function` level)."""
    named = None if not isinstance(choice, FunctionToolChoice) else \
        NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    try:
        return check_tool_request(tools, named or choice, parallel)  # type: ignore[arg-type]
    except PydanticCustomError as error:
        context = dict(error.context or {})
        if isinstance(context.get("param"), str):
            context["param"] = context["param"].replace(".function.", ".").replace(".function", "")
        raise PydanticCustomError(error.type, error.message_template, context) from None


def _screen_tools(tools: Any) -> None:
    """Hosted tools, and the keys of a function tool that ask for what coserve does not do, are a 400
    naming them; an unknown key is OpenAI's unknown-parameter 400."""
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            raise param_error(f"tools[{index}].type", f"'{kind}' is a hosted tool, which this server does not "
                                                      "run; only 'function' tools are supported")
        if kind != "function":
            continue
        for key, value in tool.items():
            if key in _TOOL_UNUSED:
                if value not in _TOOL_UNUSED[key]:
                    raise param_error(f"tools[{index}].{key}", f"'{key}' is not supported by this server")
            elif key not in _TOOL_KEYS:
                raise unknown_param_error(nested_param("tools", [index, key]))
        if not isinstance(tool.get("name"), str):
            raise param_error(f"tools[{index}].name", "a function tool needs a 'name'")


__all__ = ["JsonSchemaFormat", "ResponseCreateRequest", "TextConfig", "TextFormat"]
