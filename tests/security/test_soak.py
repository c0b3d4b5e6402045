"""The tenant boundary's soak (issue 45), briefly: `benchmarks/soak_tenants.py` on the tiny llama, as a user
runs it (a `coserve serve --local --enable-python-graders` subprocess, the official `openai` and `tinker`
clients). The attacker runs every case of the issue in a loop for 20 s beside the victim: the victim sees
no error and keeps chatting (with its fine-tuned model too) and training, every attack is refused or
contained (no 5xx, no escape), and `/health` answers every poll within 1 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from local_server import SERVE_ENV, free_port
from sandbox_support import require_sandbox

require_sandbox()
pytestmark = pytest.mark.slow
SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_tenants.py"
CASES = {  # at least these, each answered: one of each kind of the "What happens"
    "grader_reads_secrets", "grader_writes_store", "grader_signals_server", "grader_audit_hook_off_subprocess_ctypes",
    "grader_network_to_server", "grader_setsid_grandchild", "grader_setsid_grandchild_outlived",
    "tinker_oov_forward_backward", "tinker_oov_forward", "completions_oov_prompt", "tinker_zstd_bomb",
    "tinker_csr_shape_2_40", "tinker_sparse_shape_2_20_squared", "upload_dpo_lone_surrogate",
    "upload_nested_100k_deep", "upload_invalid_utf8", "formula_4000000_pow_1000000", "formula_1000_pow_1000",
    "grader_of_8192_rouge_l", "rouge_l_huge_texts", "idle_runs_wake_all_at_once", "saves_past_quota",
    "saves_on_disk_within_quota", "tinker_save_name_newline", "create_session_flood", "telemetry_flood",
}


def test_a_brief_soak_leaves_the_victim_unharmed(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(SOAK), "--model", str(llama_dir), "--warmup-s", "5", "--quiet-s", "5",
                           "--duration-s", "20", "--port", str(free_port()), "--json", str(out)],
                          capture_output=True, text=True, timeout=400, env=SERVE_ENV, cwd=SOAK.parents[1])
    assert out.is_file(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    victim, attacks, health = result["victim"], result["attacks"], result["health"]
    assert victim["errors"] == 0, victim["error_examples"]
    assert attacks["not_refused_or_contained"] == [], {n: attacks["answers"][n]
                                                       for n in attacks["not_refused_or_contained"]}
    assert CASES <= set(attacks["answers"]), sorted(CASES - set(attacks["answers"]))
    assert health["polls"] > 50 and health["failures"] == 0 and health["slowest_ms"] < 1000, health
    attack = victim["attack"]
    assert attack["chat_stream_ttft_ms"]["n"] > 0 and attack["chat_plain_latency_ms"]["n"] > 0, attack
    assert attack["tinker_rounds"] > 0, attack
    assert any(job["status"] == "succeeded" for job in victim["jobs"]), victim["jobs"]
    assert attack["chats_with_fine_tuned_model"] + victim["quiet"]["chats_with_fine_tuned_model"] > 0, victim
    assert result["passed"] and proc.returncode == 0, proc.stderr[-3000:]
