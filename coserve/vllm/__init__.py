"""vLLM as coserve's engine (`--engine vllm`): one vLLM step computing exactly the plan's chunks, and
coserve's trainer on zero-copy views of vLLM's weights. Every vLLM internal used is in `backend` and
`patches`. (Inside this package `import vllm` is vLLM itself: imports are absolute.)"""
