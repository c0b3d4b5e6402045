"""Fine-tuning job life cycle through the real server (`--local`: uvicorn, the SchedulerActor with the
hybrid token policy, the engine loop), driven by the official `openai` client and httpx.

What `test_fine_tuning_http.py` leaves out: pause and resume, `estimated_finish`, training from one of
the tenant's own fine-tuned models, a job that fails after it was accepted (over the tenant's training
token quota) and the `error` it reports, a LoRA rank above the engine's, the Prometheus metrics of training
and of the chats served, and a checkpoint that answers chats before its job ends.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai.types.fine_tuning import FineTuningJob
from safetensors.torch import load

from coserve.jobs.manager import RECONCILE_INTERVAL_S
from local_server import TERMINAL, LocalServer, local_server, poll_job, scrape, upload_jsonl

ACME, GLOBEX = "sk-acme-life-0123456789", "sk-globex-life-0123456789"
INITECH, SMALLCO = "sk-initech-life-0123456789", "sk-smallco-life-0123456789"
# Below what the 12 examples of LINES train (78 tokens), above what 10 one-token answers do.
SMALL_TOKEN_QUOTA = 50
LINES = [{"messages": [{"role": "user", "content": f"Say the number {i}"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]
PING = [{"role": "user", "content": "ping"}]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    tenants = {
        "acme": {"api_keys": [ACME]},
        "globex": {"api_keys": [GLOBEX]},
        # Its own tenant so its token counters hold exactly what the metrics test did.
        "initech": {"api_keys": [INITECH]},
        "smallco": {"api_keys": [SMALLCO], "limits": {"max_training_tokens_per_job": SMALL_TOKEN_QUOTA}},
    }
    # No SLOs given: the policy's defaults, which /metrics counts attainment against.
    with local_server(llama_dir, tmp_path_factory.mktemp("ft-life"), tenants) as srv:
        yield srv


def client(srv: LocalServer, key: str = ACME) -> openai.OpenAI:
    return srv.client(key)


def step_events(oa: openai.OpenAI, job_id: str) -> list[dict]:
    """The job's training-step metrics (validation metrics have no `train_loss` of their own step),
    oldest first."""
    events = list(oa.fine_tuning.jobs.list_events(job_id, limit=100))  # every page, newest first
    return [e.data for e in reversed(events) if e.type == "metrics" and "valid_loss" not in e.data]


def chat(oa: openai.OpenAI, model: str, max_tokens: int = 4) -> openai.types.chat.ChatCompletion:
    reply = oa.chat.completions.create(model=model, messages=PING, max_tokens=max_tokens, temperature=0)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
    return reply


def adapter(srv: LocalServer, model: str, key: str = ACME) -> tuple[dict, dict[str, torch.Tensor]]:
    """The PEFT config and weights of a fine-tuned model, downloaded."""
    response = httpx.get(f"{srv.url}/v1/models/{model}/adapter",
                         headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        config = json.load(tar.extractfile("adapter_config.json"))  # type: ignore[arg-type]
        weights = load(tar.extractfile("adapter_model.safetensors").read())  # type: ignore[union-attr]
    return config, weights


def metric(srv: LocalServer, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for line in scrape(srv.url).splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@pytest.fixture(scope="module")
def first_job(server: LocalServer) -> FineTuningJob:
    """A succeeded acme job with a rank-4 LoRA (not the default 16), to train from."""
    oa = client(server)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES), seed=3,
                                     suffix="first", hyperparameters={"n_epochs": 2, "batch_size": 4},
                                     extra_body={"lora": {"r": 4, "lora_alpha": 8}})
    job = poll_job(oa, job.id)
    assert job.status == "succeeded", job.error
    return job


def test_pause_and_resume(server: LocalServer) -> None:
    oa = client(server)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES), seed=1,
                                     hyperparameters={"n_epochs": 10, "batch_size": 2},
                                     extra_body={"lora": {"r": 4}})
    poll_job(oa, job.id, lambda j: j.status == "running" and (j.trained_tokens or 0) > 0)

    paused = oa.fine_tuning.jobs.pause(job.id)
    assert paused.id == job.id and paused.status == "paused"
    # The scheduler applies the pause at its next reconcile; a step in flight may still land.
    time.sleep(4 * RECONCILE_INTERVAL_S)
    before = oa.fine_tuning.jobs.retrieve(job.id)
    steps_before = len(step_events(oa, job.id))
    for _ in range(5):  # the engine keeps iterating for inference meanwhile
        chat(oa, server.base)
        time.sleep(0.1)
    after = oa.fine_tuning.jobs.retrieve(job.id)
    assert after.status == "paused"
    assert after.trained_tokens == before.trained_tokens and len(step_events(oa, job.id)) == steps_before
    assert steps_before < 60  # 12 examples / 2 x 10 epochs: it was paused part-way

    resumed = oa.fine_tuning.jobs.resume(job.id)
    assert resumed.status == "queued"  # the scheduler moves it back to running
    with pytest.raises(openai.BadRequestError):
        oa.fine_tuning.jobs.resume(job.id)  # only a paused job can be resumed
    done = poll_job(oa, job.id)
    assert done.status == "succeeded", done.error
    assert done.trained_tokens > after.trained_tokens
    # Every optimizer step ran exactly once across the pause.
    assert [d["step"] for d in step_events(oa, job.id)] == list(range(1, 61))
    messages = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert "Job paused by request" in messages and "Job resumed by request" in messages
    chat(oa, done.fine_tuned_model)

    for action in (oa.fine_tuning.jobs.pause, oa.fine_tuning.jobs.resume):
        with pytest.raises(openai.BadRequestError) as err:
            action(job.id)
        assert err.value.status_code == 400
        assert err.value.body["code"] == "invalid_job_status"
        assert err.value.body["param"] == "fine_tuning_job_id" and "succeeded" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client(server, GLOBEX).fine_tuning.jobs.pause(job.id)


def test_estimated_finish_while_running_then_null(server: LocalServer) -> None:
    oa = client(server)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES), seed=2,
                                     hyperparameters={"n_epochs": 2, "batch_size": 2},
                                     extra_body={"lora": {"r": 4}})
    assert job.estimated_finish is None  # nothing to estimate from before the first step
    seen: list[tuple[float, int]] = []  # (when retrieved, estimated_finish) while running
    deadline = time.monotonic() + 60
    while job.status not in TERMINAL and time.monotonic() < deadline:
        asked_at = time.time()
        job = oa.fine_tuning.jobs.retrieve(job.id)
        if job.status == "running" and job.estimated_finish is not None:
            seen.append((asked_at, job.estimated_finish))
        time.sleep(0.05)
    assert job.status == "succeeded", job.error
    assert seen, "estimated_finish was never set while the job ran"
    asked_at, first = seen[0]
    # Set from the first step on, with most of the 12 steps still to do: a time ahead, within reason.
    assert isinstance(first, int) and asked_at - 1 <= first <= asked_at + 120
    assert all(job.created_at <= estimate for _, estimate in seen)
    assert job.estimated_finish is None and job.finished_at is not None
    assert job.created_at <= job.finished_at <= time.time() + 1


def test_fine_tune_a_fine_tuned_model(server: LocalServer, first_job: FineTuningJob) -> None:
    oa = client(server)
    base_model = first_job.fine_tuned_model
    job = oa.fine_tuning.jobs.create(model=base_model, training_file=upload_jsonl(oa, LINES), seed=3,
                                     suffix="second", hyperparameters={"n_epochs": 1, "batch_size": 4})
    assert job.model == base_model
    job = poll_job(oa, job.id)
    assert job.status == "succeeded", job.error
    assert job.model == base_model
    assert job.fine_tuned_model.startswith(f"ft:{server.base}:acme:second:")
    chat(oa, job.fine_tuned_model)

    # It started from the first adapter: its LoRA settings (rank 4, not the default 16), and from
    # its trained weights (the same data and seed now starts at a lower loss).
    first_config, first_weights = adapter(server, base_model)
    config, weights = adapter(server, job.fine_tuned_model)
    assert config["r"] == first_config["r"] == 4 and config["lora_alpha"] == 8
    assert weights.keys() == first_weights.keys()
    assert any(not torch.equal(weights[k], first_weights[k]) for k in weights)  # trained further
    first_losses = [d["train_loss"] for d in step_events(oa, first_job.id)]
    losses = [d["train_loss"] for d in step_events(oa, job.id)]
    assert losses[0] < first_losses[0], (losses, first_losses)

    # LoRA settings cannot apply to an adapter that already exists: refused, not silently ignored.
    with pytest.raises(openai.BadRequestError) as err:
        oa.fine_tuning.jobs.create(model=base_model, training_file=upload_jsonl(oa, LINES),
                                   extra_body={"lora": {"r": 16}})
    assert err.value.body["param"] == "lora" and err.value.body["code"] == "invalid_lora"

    # Another tenant's fine-tuned model is not a model it can train from (nor learns it exists).
    with pytest.raises(openai.BadRequestError) as err:
        client(server, GLOBEX).fine_tuning.jobs.create(
            model=base_model, training_file=upload_jsonl(client(server, GLOBEX), LINES))
    assert err.value.status_code == 400
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_available"


def test_job_over_training_token_quota_fails_with_reason(server: LocalServer) -> None:
    oa = client(server, SMALLCO)
    file_id = upload_jsonl(oa, LINES)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=file_id,
                                     hyperparameters={"n_epochs": 1, "batch_size": 4})
    assert job.status == "validating_files"  # the size is only known once the file is tokenized
    job = poll_job(oa, job.id)
    assert job.status == "failed"
    assert job.error is not None and job.error.code == "quota_exceeded"
    assert job.error.param == "training_file"
    match = re.search(r"has (\d+) training tokens, over max_training_tokens_per_job=(\d+)",
                      job.error.message)
    assert match is not None, job.error.message
    assert int(match.group(1)) > SMALL_TOKEN_QUOTA == int(match.group(2))
    assert job.fine_tuned_model is None and not job.trained_tokens and job.finished_at is not None
    errors = [e for e in oa.fine_tuning.jobs.list_events(job.id).data if e.level == "error"]
    assert len(errors) == 1 and "max_training_tokens_per_job" in errors[0].message
    assert not [m.id for m in oa.models.list().data if m.id.startswith("ft:")]
    # Within the quota, the tenant's job runs (10 examples with 1-token answers).
    short = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
             for _ in range(10)]
    ok = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, short),
                                    hyperparameters={"n_epochs": 1, "batch_size": 5},
                                    extra_body={"lora": {"r": 2}})
    ok = poll_job(oa, ok.id)
    assert ok.status == "succeeded" and 0 < ok.trained_tokens <= SMALL_TOKEN_QUOTA, ok.error


def test_a_rank_above_the_engines_is_refused_up_front(server: LocalServer) -> None:
    oa = client(server)
    # The API's bound is 256; this server's engine holds ranks up to 64 (its max_lora_rank).
    with pytest.raises(openai.BadRequestError) as err:
        oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES),
                                   extra_body={"lora": {"r": 128}})
    body = err.value.body
    assert body["param"] == "lora.r" and body["code"] == "invalid_lora" and "max_lora_rank 64" in body["message"]
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES),
                                     hyperparameters={"n_epochs": 1, "batch_size": 4},
                                     extra_body={"lora": {"r": 64}})
    assert poll_job(oa, job.id).status == "succeeded"


def test_metrics_count_training_tokens_and_slo_attainment(server: LocalServer) -> None:
    oa = client(server, INITECH)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES),
                                     hyperparameters={"n_epochs": 1, "batch_size": 4},
                                     extra_body={"lora": {"r": 4}})
    job = poll_job(oa, job.id)
    assert job.status == "succeeded", job.error
    # Every trained token of every optimizer step is counted, for the tenant that trained.
    finetune = metric(server, "coserve_tokens_total", kind="finetune", tenant="initech")
    assert finetune == job.trained_tokens > 0
    assert metric(server, "coserve_finetune_tokens_per_second") > 0  # the job trained within the last minute

    ttft_before = metric(server, "coserve_slo_requests_total", slo="ttft")
    tpot_before = metric(server, "coserve_slo_requests_total", slo="tpot")
    replies = [chat(oa, model, max_tokens=5) for model in (server.base, job.fine_tuned_model, server.base)]
    # Every request's first token is checked against the TTFT SLO; its TPOT when it had 2+ tokens.
    assert metric(server, "coserve_slo_requests_total", slo="ttft") - ttft_before == len(replies)
    assert (metric(server, "coserve_slo_requests_total", slo="tpot") - tpot_before
            == sum(r.usage.completion_tokens >= 2 for r in replies))
    assert metric(server, "coserve_requests_total", tenant="initech") == len(replies)
    assert (metric(server, "coserve_tokens_total", kind="completion", tenant="initech")
            == sum(r.usage.completion_tokens for r in replies))
    assert (metric(server, "coserve_tokens_total", kind="prompt", tenant="initech")
            == sum(r.usage.prompt_tokens for r in replies))
    assert metric(server, "coserve_time_to_first_token_seconds_count", tenant="initech") == len(replies)


def test_checkpoint_serves_chats_before_the_job_ends(server: LocalServer) -> None:
    oa = client(server)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES), seed=5,
                                     suffix="early", hyperparameters={"n_epochs": 10, "batch_size": 4},
                                     extra_body={"lora": {"r": 4}})
    deadline = time.monotonic() + 60
    checkpoints: list = []
    while not checkpoints:
        assert time.monotonic() < deadline, "no checkpoint in 60 s"
        checkpoints = oa.fine_tuning.jobs.checkpoints.list(job.id).data
        time.sleep(0.05)
    ckpt = checkpoints[-1]  # the oldest: the end of the first epoch
    assert ckpt.step_number == 3
    assert ckpt.fine_tuned_model_checkpoint.endswith(":ckpt-step-3")
    assert ckpt.fine_tuned_model_checkpoint in [m.id for m in oa.models.list().data]
    reply = chat(oa, ckpt.fine_tuned_model_checkpoint)
    assert reply.model == ckpt.fine_tuned_model_checkpoint
    # ... while the job still trains (27 of its 30 steps were left when the checkpoint appeared).
    running = oa.fine_tuning.jobs.retrieve(job.id)
    assert running.status == "running" and running.fine_tuned_model is None
    with pytest.raises(openai.NotFoundError):
        client(server, GLOBEX).chat.completions.create(
            model=ckpt.fine_tuned_model_checkpoint, messages=PING, max_tokens=2)
    done = poll_job(oa, job.id)
    assert done.status == "succeeded", done.error
    chat(oa, ckpt.fine_tuned_model_checkpoint)  # and still after it ended
