"""Tool calling, torch-free: what a request asks for, the call formats of template families, their parsers.
Imported by: frontend, api.

Tool calling (function calling) on `/v1/chat/completions`, torch-free.

`spec` is what a request asks for (crosses from the gateway to the scheduler); `family` the tool-call
text formats of chat-template families (hermes, Llama 3.x JSON, Mistral `[TOOL_CALLS]`) and how a
template's is detected; `parser` what reading calls out of the text gives, with one parser per format
(`tagged_parser`, `leading_json_parser`, `marked_array_parser`, over `json_scan`); `call_layout` and
`call_grammar` the llguidance grammar that forces a call (`tool_choice` `required` or a named function);
`call_ids` the call ids a family's templates take; `system_prompt` the tools described in a system
message for templates that render none."""
