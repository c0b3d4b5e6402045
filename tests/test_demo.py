"""`coserve demo` (the offline demo) generates through base and LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.cli import main


def test_demo_prints_replies_for_base_and_adapter(llama_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.symlink_to(llama_dir, target_is_directory=True)
    assert main(["demo", "--model", str(model), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("[base]") == 2 and out.count("[lora:demo-lora]") == 2
    assert "tokens/s" in out
    assert (tmp_path / "model-demo-lora" / "adapter_model.safetensors").is_file()
