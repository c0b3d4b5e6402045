"""`coserve bench trainer` runs end to end (one timed round on the tiny model) and writes the issue's
JSON shape with real measurements: the windowed trainer keeps fewer activation bytes than peft."""

from __future__ import annotations

import json
from pathlib import Path

from coserve.cli import main


def test_bench_trainer_writes_both_arms(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "trainer.json"
    code = main(["bench", "trainer", "--quick", "--pairs", "1", "--warmup", "0", "--threads", "1",
                 "--schedules", "w128", "--model-dir", str(llama_dir), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    for arm in ("coserve", "hf_peft"):
        assert result[arm]["activation_bytes_per_token"] > 0 and result[arm]["tokens_per_s"] > 0
    assert result["coserve"]["memory_ratio_vs_hf"] < 1.0
    assert result["meta"]["workload"]["seq_len"] == 512
