"""`coserve serve`: bad settings fail fast with a clear message; `--local` serves the openai client."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from local_server import serve_subprocess

from coserve.cli import main

KEY = "sk-cli-tenant-0123"


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(json.dumps({"tenants": {"cli": {"api_keys": [KEY]}}}))
    return path


@pytest.mark.parametrize(("extra", "message"), [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-batch-tokens", "-3"], "--max-batch-tokens must be >= 1"),
    (["--adapter-slots", "0"], "--adapter-slots must be >= 1"),
    (["--tpot-slo-ms", "0"], "--tpot-slo-ms must be > 0"),
    (["--max-stall-ms", "30", "--tpot-slo-ms", "50"], "--max-stall-ms must be a number >= the TPOT SLO (50 ms)"),
    (["--max-stall-ms", "80"], "--max-stall-ms must be a number >= the TPOT SLO (100 ms)"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-n", "0"], "--max-n must be in 1..128"),
    (["--max-n", "129"], "--max-n must be in 1..128 (OpenAI's bound on n), got 129"),
    (["--dtype", "float8"], "--dtype must be one of"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
])
def test_bad_settings_exit_nonzero_with_message(llama_dir: Path, tenants_file: Path, extra: list[str],
                                                 message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local", *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_serve_settings_reach_the_hybrid_policy(llama_dir: Path, tenants_file: Path) -> None:
    from coserve.policies.config import SchedulerConfig
    from coserve.serve import ServeOptions

    opts = ServeOptions(model=str(llama_dir), tenants=str(tenants_file), tpot_slo_ms=80.0, max_stall_ms=240.0)
    opts.validate()
    layout = SimpleNamespace(num_kv_blocks=64, block_size=16, max_model_len=256, num_adapter_slots=2,
                             max_lora_rank=8)
    policy = opts.policy_factory(opts.load_tenants())(SchedulerConfig(max_model_len=256), layout)
    assert policy.config.tpot_slo_ms == 80.0 and policy.config.max_stall_ms == 240.0


def test_bad_model_or_tenants(llama_dir: Path, tenants_file: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path), "--tenants", str(tenants_file)]) == 2
    assert "not a model folder" in capsys.readouterr().err
    assert main(["serve", "--model", str(llama_dir), "--tenants", str(tmp_path / "none.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: {x: {api_keys: []}}")
    assert main(["serve", "--model", str(llama_dir), "--tenants", str(bad)]) == 2
    assert "api_keys" in capsys.readouterr().err


def test_serve_local_subprocess(llama_dir: Path, tenants_file: Path, tmp_path: Path) -> None:
    with serve_subprocess(llama_dir, tenants_file, tmp_path / "data", KEY) as (proc, oa):
        assert [m.id for m in oa.models.list().data] == [llama_dir.name]
        out = oa.chat.completions.create(model=llama_dir.name, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4)
        assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    assert proc.returncode == 0  # Ctrl-C stops it cleanly


def test_serve_loads_a_latency_profile_fitted_here_and_refuses_another(
        llama_dir: Path, tenants_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace

    from coserve.policies.config import SchedulerConfig
    from coserve.policies.latency import LatencyModel
    from coserve.serve import ServeOptions

    opts = ServeOptions(model=str(llama_dir), tenants=str(tenants_file), dtype="float32")
    fingerprint = opts.policy_factory(opts.load_tenants()).fingerprint  # this model, machine and dtype
    coefficients = {"constant": 0.004, "decode_tokens": 0.0002, "ft_forward_tokens": 0.0003}
    here, elsewhere = tmp_path / "here.json", tmp_path / "elsewhere.json"
    here.write_text(LatencyModel(fingerprint, coefficients).to_json())
    elsewhere.write_text(LatencyModel(replace(fingerprint, machine="another box"), coefficients).to_json())

    opts = replace(opts, latency_profile=str(here))
    opts.validate()
    layout = SimpleNamespace(num_kv_blocks=64, block_size=16, max_model_len=256, num_adapter_slots=2,
                             max_lora_rank=8)
    policy = opts.policy_factory(opts.load_tenants())(SchedulerConfig(max_model_len=256), layout)
    assert {k: policy.latency.coefficients[k] for k in coefficients} == coefficients

    args = ["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local", "--dtype", "float32"]
    assert main([*args, "--latency-profile", str(elsewhere)]) == 2
    assert "another model/machine (differs in machine)" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    assert main([*args, "--latency-profile", str(tmp_path / "broken.json")]) == 2
    assert "--latency-profile" in capsys.readouterr().err
