"""Tool calling (function calling) on `/v1/chat/completions`, torch-free.

`spec` is what a request asks for (crosses from the gateway to the scheduler), `family` the tool-call
text format of a chat-template family and how it is detected, `grammar` the llguidance grammar that
forces a call (`tool_choice` `required` or a named function), `parser` reads calls out of the text.
"""
