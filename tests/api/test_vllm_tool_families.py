"""The Llama 3.x JSON and Mistral `[TOOL_CALLS]` families on `coserve serve --engine vllm`: vLLM's
structured output enforces the same forced-call grammars (tiny models with the real Llama 3.2 and Mistral
Nemo templates), and the replies read back as valid calls, streamed or not. coserve's own engine:
test_tool_families.py. A module of its own: one vLLM engine at a time (test_vllm_models.py says why)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from local_server import LocalServer, local_server
from tool_cases import check_forced_calls, check_streamed_calls
from vllm_support import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve.contract.engine import EngineKind  # noqa: E402

KEY = "sk-vllm-tool-families-0123"


@pytest.fixture(scope="module", params=["llama3.2", "mistral"])
def server(request: pytest.FixtureRequest, tool_model_dirs: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tool_model_dirs[request.param], tmp_path_factory.mktemp("vllm-families"),
                      {"t": {"api_keys": [KEY]}}, engine=EngineKind.VLLM) as srv:
        yield srv


def test_forced_calls_are_valid_calls_streamed_or_not(server: LocalServer) -> None:
    check_forced_calls(server.client(KEY), server.base)
    check_streamed_calls(server.client(KEY), server.base)
