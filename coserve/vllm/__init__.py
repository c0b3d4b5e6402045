"""vLLM as coserve's engine (`--engine vllm`): one vLLM step per plan, the trainer on views of its weights.
Imported by: backends, server.

Every vLLM internal used is in `backend` and `patches`. (Inside this package `import vllm` is vLLM itself:
imports are absolute.)"""
