"""The engine's names: "torch" is coserve's own engine, and "native" (its name before) still names it, on the
command line, in a Serve config and in `LLM(engine=...)` alike (they all parse with `EngineKind.parse`)."""

from __future__ import annotations

import pytest

from coserve.cli import build_parser
from coserve.contract.engine import EngineKind


@pytest.mark.parametrize(("name", "kind"), [("torch", EngineKind.TORCH), ("native", EngineKind.TORCH),
                                            ("vllm", EngineKind.VLLM), (EngineKind.VLLM, EngineKind.VLLM)])
def test_each_name_parses_to_its_kind(name: str | EngineKind, kind: EngineKind) -> None:
    assert EngineKind.parse(name) is kind


def test_an_unknown_name_lists_the_kinds() -> None:
    with pytest.raises(ValueError, match="engine must be one of torch, vllm, got 'tensorrt'"):
        EngineKind.parse("tensorrt")


@pytest.mark.parametrize("flag", ["native", "torch"])
def test_serve_takes_both_names_of_its_engine(flag: str) -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--tenants", "t.yaml", "--engine", flag])
    assert args.engine is EngineKind.TORCH
