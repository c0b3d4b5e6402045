"""deploy/: the Serve config and the KubeRay RayService manifest name the real application builder with
arguments it accepts, and agree with each other and with the container file. (tests/actors/
test_ray_serving.py runs deploy/serve.yaml's application on a real Ray cluster.)"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from coserve.server.assembly import app_builder
from coserve.server.options import options_from_args
from deploy_config import DEPLOY, GPU_ONLY_ARGS, SERVE_CONFIGS, local_args, serve_config


def _rayservice() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(json.dumps({"tenants": {"acme": {"api_keys": ["sk-acme-deploy-0123"]}}}))
    return path


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_is_valid_and_names_the_builder(name: str) -> None:
    config = ServeDeploySchema.model_validate(serve_config(name))
    (app,) = config.applications
    module, _, attr = app.import_path.partition(":")
    assert getattr(importlib.import_module(module), attr) is app_builder
    assert app.route_prefix == "/" and config.http_options.port == 8000


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_every_config_argument_is_accepted(llama_dir: Path, tenants_file: Path, tmp_path: Path, name: str) -> None:
    """Through coserve's own loader (`options_from_args`, what `app_builder` runs), with this machine's
    paths and one CPU engine in place of the GPUs; every other value lands in `ServeOptions` as written."""
    (app,) = serve_config(name)["applications"]
    machine = ("model", "tenants", "data_dir", "device", "dtype", "engines", *GPU_ONLY_ARGS)
    assert set(machine) <= set(app["args"]) and app["args"]["device"] == "cuda"
    opts = options_from_args(local_args(app["args"], llama_dir, tenants_file, tmp_path / "data"))
    for arg, value in app["args"].items():
        if arg not in machine:
            assert getattr(opts, arg) == value, arg


def _gpus_left(total_gpus: int, args: dict[str, Any]) -> int:
    """Dedicated workers a cluster of `total_gpus` GPUs holds beside the config's engines (coserve's own
    capacity arithmetic)."""
    from coserve.finetune.dedicated import DedicatedSettings, capacity
    from coserve.server.engine_count import EngineRoom
    from coserve.server.engine_pool import engine_bundle

    engines = EngineRoom("GPU", total_gpus, "the cluster").count(args["engines"])  # fits, or raises
    held = {name: amount * engines for name, amount in engine_bundle(args["device"]).items()}
    per_worker = DedicatedSettings(use_gpu=True).per_worker()
    return capacity({"GPU": float(total_gpus), "CPU": 64.0}, per_worker, held)


def test_the_multi_gpu_config_fills_one_node_of_8_gpus() -> None:
    (app,) = serve_config("serve-multi-gpu.yaml")["applications"]
    assert app["args"]["engines"] == 6 and _gpus_left(8, app["args"]) == app["args"]["dedicated_workers"] == 2


@pytest.mark.parametrize("change, match", [
    ({"port": 9000}, r"unknown coserve argument\(s\) \['port'\]"),
    ({"max_num_seqs": "64"}, "max_num_seqs must be int"),
    ({"tpot_slo_ms": True}, "tpot_slo_ms must be float"),
    ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1"),
    ({"max_n": 200}, "--max-n must be in 1..128"),
    ({"max_n": "16"}, "max_n must be int"),
    ({"device": "tpu"}, "device"),
    ({"dedicated_workers": 0}, "--dedicated-workers must be in 1..1024"),
    ({"dedicated_min_tokens": 0}, "--dedicated-min-tokens must be >= 1"),
    ({"dedicated_min_tokens": "1000"}, "dedicated_min_tokens must be int"),
    ({"finetune_min_share": 0}, r"--finetune-min-share must be a fraction in \(0, 1\), got 0"),
    ({"finetune_min_share": "0.05"}, "finetune_min_share must be float"),
    ({"engines": 0}, "--engines must be >= 1"),
    ({"engines": "2"}, "engines must be int"),
    ({"lenient_params": "yes"}, "lenient_params must be bool"),
    ({"public_metrics": 1}, "public_metrics must be bool"),
    ({"engines": 100_000}, "--engines 100000: this machine has"),
])
def test_bad_arguments_are_named(llama_dir: Path, tenants_file: Path, tmp_path: Path, change: dict[str, Any],
                                 match: str) -> None:
    (app,) = serve_config()["applications"]
    args = {**local_args(app["args"], llama_dir, tenants_file, tmp_path / "data"), **change}
    with pytest.raises(ValueError, match=match):
        app_builder(args)


def test_the_memory_arguments_reach_the_engines_and_are_checked(llama_dir: Path, tenants_file: Path,
                                                                 tmp_path: Path) -> None:
    """`kv_cache_memory_gb` and `max_model_len` land in every engine's config; `gpu_memory_utilization` is
    serve.yaml's for its GPUs (vLLM's meaning, passed on to the engines) and refused on the CPU, naming the
    flag; a cache too small for one `max_model_len` sequence plus a fine-tuning window is refused before the
    model loads, saying what it holds and what to change."""
    from dataclasses import replace

    (app,) = serve_config()["applications"]
    assert app["args"]["gpu_memory_utilization"] == 0.9 and app["args"]["device"] == "cuda"
    gpu = replace(options_from_args(local_args(app["args"], llama_dir, tenants_file, tmp_path / "data")),
                  device="cuda", gpu_memory_utilization=app["args"]["gpu_memory_utilization"])
    assert gpu.engine_config().gpu_memory_utilization == 0.9  # not validated here: this machine has no CUDA
    args = local_args(app["args"], llama_dir, tenants_file, tmp_path / "data")
    opts = options_from_args({**args, "kv_cache_memory_gb": 0.0625, "max_model_len": 512,
                              "dedicated_pause_timeout_s": 30})
    config = opts.engine_config()
    assert (config.kv_cache_memory_gb, config.max_model_len) == (0.0625, 512)
    assert opts.dedicated_settings().pause_timeout_s == 30
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization applies to CUDA only \(--device cpu\)"):
        options_from_args({**args, "gpu_memory_utilization": 0.5})
    with pytest.raises(ValueError, match=r"^--kv-cache-memory-gb 1e-05: the KV cache holds \d+ tokens, and serving "
                                         r"needs at least 768: one sequence of --max-model-len 512"):
        options_from_args({**args, "kv_cache_memory_gb": 0.00001, "max_model_len": 512})
    with pytest.raises(ValueError, match="max_model_len must be int"):
        options_from_args({**args, "max_model_len": "512"})
    with pytest.raises(ValueError, match="--dedicated-pause-timeout-s must be a number > 0, got 0"):
        options_from_args({**args, "dedicated_pause_timeout_s": 0})


def test_boolean_arguments_are_yaml_booleans(llama_dir: Path, tenants_file: Path, tmp_path: Path) -> None:
    (app,) = serve_config()["applications"]
    args = local_args(app["args"], llama_dir, tenants_file, tmp_path / "data")
    opts = options_from_args({**args, "lenient_params": True, "public_metrics": True})
    assert opts.lenient_params and opts.public_metrics


def test_model_and_tenants_are_required(tenants_file: Path) -> None:
    with pytest.raises(ValueError, match=r"needs the argument\(s\) \['model'\]"):
        options_from_args({"tenants": str(tenants_file)})


def test_rayservice_embeds_the_serve_config_and_the_image() -> None:
    manifest = _rayservice()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded == serve_config()
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    (gpu_group,) = cluster["workerGroupSpecs"]
    worker = gpu_group["template"]["spec"]["containers"][0]
    gpus = gpu_group["replicas"] * int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == 4 and gpu_group["minReplicas"] == gpu_group["replicas"]
    args = embedded["applications"][0]["args"]
    assert _gpus_left(gpus, args) == args["dedicated_workers"]  # 2 engines and a dedicated run's 2 workers
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # no engine on the head
    data_dir = embedded["applications"][0]["args"]["data_dir"]
    for container in (head, worker):  # the gateway (head) and the scheduler and engine all see the data dir
        assert any(m["mountPath"] == data_dir for m in container["volumeMounts"])
        assert container["image"] == "coserve:latest"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:(\S+?)-py311", dockerfile, re.M)
    assert base is not None and base.group(1) == cluster["rayVersion"]
    assert f'"ray[serve,train]=={cluster["rayVersion"]}"' in dockerfile  # pip must not move Ray
