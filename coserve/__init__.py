"""coserve: LLM inference and LoRA fine-tuning for many tenants on one base model.

The offline API mirrors vLLM's: `from coserve import LLM, SamplingParams, LoRARequest`.
"""

from coserve.lora_request import LoRARequest
from coserve.outputs import CompletionOutput, Logprob, RequestOutput
from coserve.policies.request import SamplingParams
from coserve.policies.structured_output import StructuredOutput


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it lazily so the policy layer stays light.
    if name == "LLM":
        from coserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutput", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob"]
