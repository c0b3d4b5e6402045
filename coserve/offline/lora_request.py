"""`LoRARequest`, the offline API's handle on a PEFT adapter folder (vLLM's signature)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Run a request through the LoRA adapter stored in PEFT format at `lora_path`.

    Args:
        lora_name: a display name.
        lora_int_id: a unique id >= 1; requests with the same id share one loaded adapter.
        lora_path: the adapter folder (`adapter_config.json` + `adapter_model.safetensors`).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
