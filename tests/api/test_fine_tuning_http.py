"""`/v1/fine_tuning/jobs` and adapter export through the real server (`--local`: uvicorn, the
SchedulerActor with the hybrid token policy, the engine loop), driven by the official `openai` client:
a job trains while chat requests are served, its events, checkpoints and models appear, the fine-tuned
model and a checkpoint answer chats, the adapter downloads as a PEFT `.tar.gz`; validation errors are
400 naming the param, other tenants get 404, cancel cancels."""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from local_server import LocalServer, local_server, upload_jsonl

ACME, GLOBEX = "sk-acme-ft-0123456789", "sk-globex-ft-0123456789"
LINES = [{"messages": [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": f"Say the number {i}"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    tenants = {"acme": {"api_keys": [ACME]}, "globex": {"api_keys": [GLOBEX]}}
    with local_server(llama_dir, tmp_path_factory.mktemp("ft-http"), tenants) as srv:
        yield srv


def client(srv: LocalServer, key: str = ACME) -> openai.OpenAI:
    return srv.client(key)


def _wait(oa: openai.OpenAI, job_id: str, base: str, timeout: float = 120) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = oa.fine_tuning.jobs.retrieve(job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            return job
        # Inference is served while the job trains.
        reply = oa.chat.completions.create(model=base, messages=[{"role": "user", "content": "ping"}],
                                           max_tokens=3)
        assert reply.choices[0].message.content is not None
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def test_fine_tuning_journey(server: LocalServer) -> None:
    oa = client(server)
    file_id, valid_id = upload_jsonl(oa, LINES), upload_jsonl(oa, LINES[:3])
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=file_id, suffix="nums", seed=3,
                                     validation_file=valid_id,
                                     hyperparameters={"n_epochs": 2, "batch_size": 4},
                                     extra_body={"lora": {"r": 8, "lora_alpha": 16}})
    assert job.object == "fine_tuning.job" and job.status == "validating_files"
    with pytest.raises(openai.NotFoundError):
        client(server, GLOBEX).fine_tuning.jobs.retrieve(job.id)

    job = _wait(oa, job.id, server.base)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model.startswith(f"ft:{server.base}:acme:nums:")
    assert job.trained_tokens > 0 and job.hyperparameters.n_epochs == 2
    events = oa.fine_tuning.jobs.list_events(job.id, limit=100).data
    metrics = [e for e in events if e.type == "metrics"]
    assert {"step", "train_loss", "total_steps"} <= set(metrics[-1].data)  # oldest last
    valid = [e.data for e in metrics if "valid_loss" in e.data]
    assert sorted(d["step"] for d in valid) == [3, 6] and all(d["valid_loss"] > 0 for d in valid)
    checkpoints = oa.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [6, 3]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-6"

    ids = [m.id for m in oa.models.list().data]
    assert job.fine_tuned_model in ids and checkpoints[1].fine_tuned_model_checkpoint in ids
    assert job.fine_tuned_model not in [m.id for m in client(server, GLOBEX).models.list().data]
    for model in (job.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        reply = oa.chat.completions.create(model=model, max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "Say the number 3"}])
        assert reply.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client(server, GLOBEX).chat.completions.create(
            model=job.fine_tuned_model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    # The adapter downloads as a PEFT folder.
    response = httpx.get(f"{server.url}/v1/models/{job.fine_tuned_model}/adapter",
                         headers={"Authorization": f"Bearer {ACME}"}, timeout=30)
    assert response.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        config = json.load(tar.extractfile("adapter_config.json"))  # type: ignore[arg-type]
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    missing = httpx.get(f"{server.url}/v1/models/{job.fine_tuned_model}/adapter",
                        headers={"Authorization": f"Bearer {GLOBEX}"}, timeout=30)
    assert missing.status_code == 404

    page = oa.fine_tuning.jobs.list(limit=1)
    assert len(page.data) == 1


def test_cancel_and_validation_errors(server: LocalServer) -> None:
    oa = client(server)
    file_id = upload_jsonl(oa, LINES)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=file_id,
                                     hyperparameters={"n_epochs": 50})
    job = oa.fine_tuning.jobs.cancel(job.id)
    assert job.status == "cancelled"
    assert _wait(oa, job.id, server.base).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        oa.fine_tuning.jobs.cancel(job.id)

    few = upload_jsonl(oa, LINES[:5])
    cases = [
        (dict(model=server.base, training_file=few), "training_file"),
        (dict(model="no-such-model", training_file=file_id), "model"),
        (dict(model=server.base, training_file="file-nope"), "training_file"),
        (dict(model=server.base, training_file=file_id, hyperparameters={"n_epochs": 0}),
         "hyperparameters.n_epochs"),
        (dict(model=server.base, training_file=file_id, suffix="x" * 65), "suffix"),
        (dict(model=server.base, training_file=file_id, extra_body={"lora": {"lora_dropout": 0.1}}),
         "lora.lora_dropout"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oa.fine_tuning.jobs.create(**kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.NotFoundError):
        oa.fine_tuning.jobs.retrieve("ftjob-000000000000000000000000")


def test_lora_values_the_store_cannot_keep_are_400(server: LocalServer) -> None:
    """Regression: `"lora_alpha": Infinity` (Python's JSON parser accepts it) and an unknown `lora` key
    holding `NaN` were a 500 (the job's JSON column refuses them); an unknown key also used to fail the
    job when it started instead of being refused here."""
    file_id = upload_jsonl(client(server), LINES)
    headers = {"Authorization": f"Bearer {ACME}", "content-type": "application/json"}
    cases = [('{"lora_alpha": Infinity}', "lora.lora_alpha"), ('{"r": 8, "scale": NaN}', "lora.scale"),
             ('{"bias": "none"}', "lora.bias")]
    for lora, param in cases:
        body = f'{{"model": "{server.base}", "training_file": "{file_id}", "lora": {lora}}}'
        response = httpx.post(f"{server.url}/v1/fine_tuning/jobs", content=body, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_training_extension_is_checked_and_dedicated_needs_ray(server: LocalServer) -> None:
    """`extra_body={"training": ...}` (where the job trains) is typed strictly, each bad value a 400 naming
    it; a dedicated Ray Train run is a clear 400 on this `--local` server (no Ray), and nothing is stored."""
    oa = client(server)
    file_id = upload_jsonl(oa, LINES)
    before = len(oa.fine_tuning.jobs.list(limit=100).data)
    cases = [({"mode": "elsewhere"}, "training.mode", "invalid_value"),
             ({"mode": "dedicated", "workers": "2"}, "training.workers", "invalid_type"),
             ({"mode": "dedicated", "workers": 2.0}, "training.workers", "invalid_type"),
             ({"mode": "dedicated", "workers": True}, "training.workers", "invalid_type"),
             ({"mode": "dedicated", "workers": 0}, "training.workers", None),
             ({"mode": "dedicated", "gpus": 1}, "training.gpus", None),
             ({"mode": "coserved", "workers": 2}, "training.workers", "invalid_training"),
             ({"workers": 2}, "training.workers", "invalid_training"),
             ({"mode": "dedicated"}, "training.mode", "dedicated_training_unavailable"),
             ({"mode": "dedicated", "workers": 2}, "training.mode", "dedicated_training_unavailable")]
    for training, param, code in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oa.fine_tuning.jobs.create(model=server.base, training_file=file_id, extra_body={"training": training})
        assert err.value.status_code == 400 and err.value.body["param"] == param, (training, err.value.body)
        assert code is None or err.value.body["code"] == code, (training, err.value.body)
    assert "without Ray (--local)" in err.value.message
    assert len(oa.fine_tuning.jobs.list(limit=100).data) == before
    # Asking for the co-served mode is what happens anyway: accepted and echoed.
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=file_id,
                                     extra_body={"training": {"mode": "coserved"}})
    assert job.model_extra["training"] == {"mode": "coserved", "workers": None}
    oa.fine_tuning.jobs.cancel(job.id)
