"""`AdapterChecker`: checks a LoRA adapter folder once (config and tensor shapes, no weights loaded,
torch-free), so that a bad adapter is refused at submit time with its own error instead of failing an
engine iteration."""

from __future__ import annotations

from coserve.model.adapter_files import check_adapter
from coserve.model.config import ModelConfig


class AdapterChecker:
    """Checks each LoRA adapter folder once and keeps the offline API's ids unique per path.

    Args:
        model_config: the base model's `ModelConfig`.
        max_rank: the engine bank's largest rank.
    """

    def __init__(self, model_config: ModelConfig, max_rank: int) -> None:
        self._model_config = model_config
        self._max_rank = max_rank
        self._paths: dict[int, str] = {}
        self._checked: set[str] = set()

    def check_path(self, path: str) -> None:
        """Check the adapter at `path` unless it was checked before.

        Raises:
            AdapterError: the adapter cannot be served on this model.
        """
        if path not in self._checked:
            check_adapter(path, self._model_config, self._max_rank)
            self._checked.add(path)

    def check(self, adapter_id: int, path: str) -> None:
        """Check the adapter at `path` for the offline API's `adapter_id` (`LoRARequest.lora_int_id`).

        Raises:
            AdapterError: the adapter cannot be served on this model.
            ValueError: `adapter_id` is already used for another path.
        """
        known = self._paths.get(adapter_id)
        if known == path:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {adapter_id} is already used for {known}")
        self.check_path(path)
        self._paths[adapter_id] = path
