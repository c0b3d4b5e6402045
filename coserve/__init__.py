"""coserve: LLM inference and LoRA fine-tuning for many tenants on one base model.

The offline API mirrors vLLM's: `from coserve import LLM, SamplingParams, LoRARequest`.
"""

from coserve.contract.sampling import SamplingParams
from coserve.contract.structured_output import StructuredOutput
from coserve.frontend.logprobs import Logprob
from coserve.offline.lora_request import LoRARequest
from coserve.offline.outputs import CompletionOutput, RequestOutput


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it lazily so the policy layer stays light.
    if name == "LLM":
        from coserve.offline.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutput", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob"]
