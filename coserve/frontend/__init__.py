"""The tokenizer side: prompts in (chat templates, tools, tokenization off the event loop, the
admission checks that need a tokenizer), text out (incremental detokenization, stop strings, decoded
logprobs), and a fine-tuning job's data (`job_prep`). Used by the offline `LLM` and the server."""
