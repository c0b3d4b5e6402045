"""The tokenizer side: prompts in (chat templates, tools, admission checks), text out (TextStream).
Imported by: jobs, api, actors, offline, server (and `coserve` itself).

The gateway's process (and the offline `LLM`'s): the `SchedulerFrontend` in front of the scheduler,
prompts in (the torch-free `Tokenizer`, chat templates, tools, tokenization off the event loop, the admission
checks that need a tokenizer), text out (`TextStream`: incremental detokenization, stop strings, decoded
logprobs). Nothing here imports torch."""
