"""`--engine vllm` at start: vLLM accepts a KV cache that holds one `--max-model-len` sequence (its own
check); coserve asks for a fine-tuning window beside it, counted in the blocks vLLM reports, and refuses
with its own message (what the cache holds, what is needed, coserve's flags). A module of its own: vLLM
keeps process-wide state, so the engine built here must not overlap another module's."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from local_server import local_app
from vllm_support import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve.actors.data_dir_lock import DataDirLock  # noqa: E402
from coserve.contract.engine import EngineKind  # noqa: E402
from coserve.contract.kv_capacity import KvCacheTooSmall  # noqa: E402
from coserve.model.config import ModelConfig  # noqa: E402
from coserve.model.memory import kv_bytes_per_token  # noqa: E402


def test_a_vllm_cache_without_room_for_a_fine_tuning_window_stops_serve(llama_dir: Path, tmp_path: Path) -> None:
    """The bytes of 510 tokens pass the check before loading (510 >= 248 + 256); vLLM's blocks hold fewer."""
    per_token = kv_bytes_per_token(ModelConfig.from_pretrained(llama_dir), 4)
    with pytest.raises(KvCacheTooSmall, match=r"^the KV cache holds \d+ tokens, and serving needs at least 504: one "
                                              r"sequence of --max-model-len 248 plus one fine-tuning window of 256 "
                                              r"tokens. Raise --kv-cache-memory-gb"):
        local_app(llama_dir, tmp_path, {"acme": {"api_keys": ["sk-vllm-kv-tenant-0123"]}}, engine=EngineKind.VLLM,
                  max_model_len=248, kv_cache_memory_gb=510 * per_token / 2**30)
    DataDirLock.check_free(tmp_path / "data")  # the server that did not start holds nothing
    gc.collect()  # the engine goes now, before another module builds one
