"""The gateway's process and the scheduler's process import no torch (only the engine's does): in a fresh
interpreter, the gateway app uploads a training file and creates a job over HTTP, its frontend renders
and tokenizes a chat, the scheduler admits and plans it, and the job manager tokenizes the training file
and starts the job; then torch is not among the loaded modules (`torch_free_run.py`)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from coserve.model.tokenizer_spec import read_tokenizer_spec

HERE = Path(__file__).parent


def test_gateway_and_scheduler_work_without_torch(llama_dir: Path, tmp_path: Path) -> None:
    spec = read_tokenizer_spec(llama_dir)  # what the engine's process reports
    (tmp_path / "tokenizer_spec.json").write_text(json.dumps(dataclasses.asdict(spec)))
    result = subprocess.run([sys.executable, str(HERE / "torch_free_run.py"), str(llama_dir), str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    prompt = AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert report["admitted"] and report["prompt_tokens"] == len(prompt)
    assert report["planned"] == [prompt] and report["chunks"] == [len(prompt)]  # planned as one prefill
    assert report["job"] == "running"
    assert report["loaded"] == []
