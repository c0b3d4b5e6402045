"""`coserve serve`: bad settings fail fast with a clear message; `--local` serves the openai client."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from coserve.cli import main
from local_server import SERVE_ENV, serve_command, serve_subprocess

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
    (["--max-upload-bytes", "0"], "--max-upload-bytes must be >= 1"),
    (["--max-n", "129"], "--max-n must be in 1..128 (OpenAI's bound on n), got 129"),
    (["--dtype", "float8"], "--dtype must be one of"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--dedicated-workers", "0"], "--dedicated-workers must be in 1..1024, got 0"),
    (["--dedicated-min-tokens", "100000"], "--dedicated-min-tokens routes jobs to Ray Train runs: it needs Ray"),
    (["--engines", "0"], "--engines must be >= 1, got 0"),
    (["--engines", "2"], "--engines 2: one engine actor per GPU runs on Ray (not --local)"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization applies to CUDA only (--device cpu): on the "
                                          "CPU the KV cache's size is --kv-cache-memory-gb"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be a fraction in (0, 1], got 1.5"),
    (["--kv-cache-memory-gb", "0"], "--kv-cache-memory-gb must be a number > 0"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--max-model-len", "100000"], "--max-model-len 100000 is more than the model's context length (2048 tokens"),
    (["--kv-cache-memory-gb", "0.0001", "--max-model-len", "2048"],
     "tokens, and serving needs at least 2304: one sequence of --max-model-len 2048 plus one fine-tuning window "
     "of 256 tokens. Raise --kv-cache-memory-gb"),
    (["--dedicated-pause-timeout-s", "0"], "--dedicated-pause-timeout-s must be a number > 0, got 0"),
    (["--finetune-min-share", "1"], "--finetune-min-share must be a fraction in (0, 1), got 1.0"),
])
def test_bad_settings_exit_nonzero_with_message(llama_dir: Path, tenants_file: Path, extra: list[str],
                                                 message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local", *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_python_graders_refuse_to_start_without_their_sandbox_naming_the_package(
        llama_dir: Path, tenants_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    code = main(["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local",
                 "--enable-python-graders"])
    assert code == 2 and "--enable-python-graders:" in (err := capsys.readouterr().err)
    assert "apt-get install bubblewrap" in err


def test_more_engines_than_cores_fail_at_start(llama_dir: Path, tenants_file: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On Ray (no --local) each CPU engine takes a core: more than there are is refused before anything
    starts (this machine's cores; a Ray cluster's CPUs when this process is connected to one, as when
    an earlier test left one up); the default is one engine on a CPU machine."""
    from coserve.server.engine_count import engine_room
    from coserve.server.options import ServeOptions

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    room = engine_room("cpu")
    cores = room.available
    code = main(["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--engines", str(cores + 1)])
    assert code == 2
    assert f"--engines {cores + 1}: {room.where} has {cores} CPU(s) and each engine takes one CPU core" in (
        capsys.readouterr().err)
    assert ServeOptions(model=str(llama_dir), tenants=str(tenants_file)).num_engines() == 1
    assert ServeOptions(model=str(llama_dir), tenants=str(tenants_file), engines=cores).num_engines() == cores


def test_serve_settings_reach_the_hybrid_policy(llama_dir: Path, tenants_file: Path) -> None:
    from coserve.inference.scheduler_config import SchedulerConfig
    from coserve.server.options import ServeOptions

    opts = ServeOptions(model=str(llama_dir), tenants=str(tenants_file), tpot_slo_ms=80.0, max_stall_ms=240.0,
                        finetune_min_share=0.2)
    opts.validate()
    layout = SimpleNamespace(num_kv_blocks=64, block_size=16, max_model_len=256, num_adapter_slots=2,
                             max_lora_rank=8)
    policy = opts.policy_factory(opts.load_tenants())(SchedulerConfig(max_model_len=256), layout)
    assert policy.config.tpot_slo_ms == 80.0 and policy.config.max_stall_ms == 240.0
    assert policy.config.finetune_min_share == policy.floor.min_share == 0.2


def test_lenient_params_flag_reaches_the_gateway_options(llama_dir: Path, tenants_file: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import coserve.server.assembly as assembly

    served: list = []
    monkeypatch.setattr(assembly, "run_local", served.append)  # the options the server would start with
    base = ["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local"]
    assert main([*base, "--lenient-params"]) == 0 and main(base) == 0
    assert [opts.lenient_params for opts in served] == [True, False]


def test_memory_flags_reach_the_engine_config(llama_dir: Path, tenants_file: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-cache-memory-gb`, `--max-model-len` and, on CUDA, `--gpu-memory-utilization` (this machine has
    no GPU: the device check is skipped here) land in every engine's `EngineConfig`."""
    import coserve.server.assembly as assembly
    import coserve.server.options as options

    served: list = []
    monkeypatch.setattr(assembly, "run_local", served.append)
    base = ["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local"]
    assert main([*base, "--kv-cache-memory-gb", "0.25", "--max-model-len", "1024",
                 "--dedicated-pause-timeout-s", "60"]) == 0
    monkeypatch.setattr(options, "_check_device", lambda device: None)
    assert main([*base, "--device", "cuda", "--gpu-memory-utilization", "0.8"]) == 0
    cpu, cuda = (opts.engine_config() for opts in served)
    assert (cpu.kv_cache_memory_gb, cpu.max_model_len, cpu.gpu_memory_utilization) == (0.25, 1024, 0.9)
    assert (cuda.kv_cache_memory_gb, cuda.max_model_len, cuda.gpu_memory_utilization) == (None, None, 0.8)
    assert served[0].dedicated_pause_timeout_s == 60
    assert main([*base, "--device", "cuda", "--gpu-memory-utilization", "0.8", "--kv-cache-memory-gb", "1"]) == 2


def test_a_kv_cache_too_small_for_the_context_stops_the_server_at_start(
        llama_dir: Path, tenants_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The engine's cache, in whole blocks, is checked once built: 510 tokens' worth of bytes passes the
    check before loading (510 >= 248 + 256) but makes 31 blocks of 16, 496 positions; the server stops
    with what the cache holds, what it needs and which flags to change, and leaves the data dir free."""
    from coserve.actors.data_dir_lock import DataDirLock
    from coserve.model.config import ModelConfig
    from coserve.model.memory import kv_bytes_per_token

    per_token = kv_bytes_per_token(ModelConfig.from_pretrained(llama_dir), 4)
    args = ["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local", "--port", "0",
            "--data-dir", str(tmp_path / "data"), "--dtype", "float32", "--max-model-len", "248",
            "--kv-cache-memory-gb", repr(510 * per_token / 2**30)]
    assert main(args) == 1
    assert capsys.readouterr().err == (
        "error: the KV cache holds 496 tokens, and serving needs at least 504: one sequence of --max-model-len 248 "
        "plus one fine-tuning window of 256 tokens. Raise --kv-cache-memory-gb (or --gpu-memory-utilization on "
        "CUDA), or lower --max-model-len to at most 240\n")
    DataDirLock.check_free(tmp_path / "data")  # not held by the server that did not start


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

    from coserve.inference.scheduler_config import SchedulerConfig
    from coserve.planner.latency import LatencyModel
    from coserve.server.options import ServeOptions

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


def test_the_banner_names_the_port_actually_bound(llama_dir: Path, tenants_file: Path, tmp_path: Path) -> None:
    """`--port 0` listens on a free port, and the banner says which, with the engine and the dtype serving
    (the default `--dtype auto`: the tiny model's config says float32); uploads over `--max-upload-bytes`
    get 413 (a flag, like the JSON body cap)."""
    cmd = serve_command(llama_dir, tenants_file, tmp_path / "data", 0)
    del cmd[cmd.index("--dtype"):cmd.index("--dtype") + 2]  # the default dtype
    cmd += ["--max-upload-bytes", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=SERVE_ENV, text=True)
    try:
        banner = ""
        while "coserve: serving" not in banner:
            line = proc.stdout.readline()
            assert line, f"the server exited: {banner}"
            banner += line
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1 \(local mode, engine torch, dtype float32\)",
                             banner).group(1))
        assert port != 0
        headers = {"Authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 60
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=10)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert models.status_code == 200
        upload = httpx.post(f"http://127.0.0.1:{port}/v1/files", headers=headers, data={"purpose": "fine-tune"},
                            files={"file": ("t.jsonl", b"x" * 4096)}, timeout=30)
        assert upload.status_code == 413 and upload.json()["error"]["code"] == "file_too_large"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_port_in_use_fails_before_the_model_loads(llama_dir: Path, tenants_file: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(llama_dir), "--tenants", str(tenants_file), "--local",
                     "--data-dir", str(tmp_path / "data"), "--port", str(port)])
    assert code == 1 and f"--port {port}: cannot listen there" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # nothing was touched
