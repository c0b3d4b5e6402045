"""`AdapterChecker`: reads a LoRA adapter once on the CPU, so that a bad adapter is refused at submit
time with its own error instead of failing an engine iteration."""

from __future__ import annotations


class AdapterChecker:
    """Checks each LoRA adapter once (on the CPU, no device memory) and keeps ids unique per path.

    Args:
        model_config: the base model's `ModelConfig`.
        max_rank: the engine bank's largest rank.
    """

    def __init__(self, model_config: object, max_rank: int) -> None:
        self._model_config = model_config
        self._max_rank = max_rank
        self._paths: dict[int, str] = {}

    def check(self, adapter_id: int, path: str) -> None:
        """Read the adapter at `path` unless already done for this id.

        Raises:
            AdapterError: the adapter cannot be served on this model.
            ValueError: `adapter_id` is already used for another path.
        """
        known = self._paths.get(adapter_id)
        if known == path:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {adapter_id} is already used for {known}")
        import torch

        from coserve.platform.lora import load_peft_adapter

        load_peft_adapter(path, adapter_id, self._model_config, self._max_rank, torch.float32,
                          torch.device("cpu"))
        self._paths[adapter_id] = path
