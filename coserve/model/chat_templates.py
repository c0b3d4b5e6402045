"""The chat templates coserve writes for its tiny test models (`chat_formats.py` pairs each with its
tokens; the real Llama 3.2 and Mistral templates are files in `data/templates/`).

`CHATML_TEMPLATE`: plain ChatML, as the llama and mistral tiny models have. It renders `role` and
`content` only, so it cannot show a model tools or tool calls (fine-tuning data with them is refused).

`QWEN_TOOLS_TEMPLATE`: the qwen2 and qwen3 tiny models' template, modelled on the real Qwen2.5 /
Qwen3 ones so that fine-tuning with tools (issue 20 item 5) is tested on the format those models use:

* a `tools` list goes into the system turn: the first system message's text, then `# Tools` with one
  `tool | tojson` line per tool inside `<tools></tools>` and the instruction to answer with
  `<tool_call>` blocks;
* an assistant message with `tool_calls` renders its content (if any), then for each call
  `\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, then `<|im_end|>`; `arguments`
  is written as is when it is a string and with `tojson` otherwise (Qwen3's rule; HF chat templates
  take arguments as a dict, which is what coserve's trainer passes);
* consecutive `tool` messages share one `user` turn, each inside `<tool_response></tool_response>`.

Without tools and tool calls it renders exactly as `CHATML_TEMPLATE` (no default system prompt, unlike
Qwen's), so every conversation without tools has the same tokens on every tiny model.
"""

from __future__ import annotations

# String content or OpenAI-style lists of {"type": "text", "text": ...} parts.
_TEXT_MACRO = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content %}{%- for part in content %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
)

_TOOL_CALLS = (
    "{{- '<|im_start|>assistant' }}"
    "{%- set content = text(message['content']) %}"
    "{%- if content %}{{- '\\n' + content }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
)

_TOOL_RESPONSE = (
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN_TOOLS_TEMPLATE = (
    _TEXT_MACRO + _TOOLS_SYSTEM
    + "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"  # already in the tools turn
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}" + _TOOL_CALLS
    + "{%- elif message['role'] == 'tool' %}" + _TOOL_RESPONSE
    + "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

