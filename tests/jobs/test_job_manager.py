"""The scheduler's `JobManager` between a real SQLite metadata store and a real engine: jobs created
through the gateway's service are validated, trained, checkpointed (servable at once), paused,
resumed, cancelled, and resumed after a restart to the same adapter as an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from coserve import LLM, LoRARequest, SamplingParams
from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.fine_tuning import FineTuningJobCreate
from coserve.api.serving.fine_tuning import FineTuningService
from coserve.contract.job_spec import JobState
from coserve.contract.trainer_state import STATE_FILE
from coserve.jobs.manager import FineTuningSettings, JobManager
from coserve.store import MetadataStore
from coserve.store.records import JobStatus
from coserve.tenancy.tenants import parse_tenants

BASE = "tiny-llama"
LINES = [{"messages": [{"role": "user", "content": f"Say the number {i}"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]
TENANTS = parse_tenants({"tenants": {"acme": {"api_keys": ["sk-acme"],
                                              "limits": {"max_concurrent_jobs": 2}},
                                     "globex": {"api_keys": ["sk-globex"]}}})


def _llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_batch_tokens=64, num_kv_blocks=96, block_size=8,
               max_model_len=256, max_lora_rank=16)


def _manager(store: MetadataStore, llm: LLM, data_dir: Path, tokenizer: Any = None) -> JobManager:
    settings = FineTuningSettings(base_model_id=BASE, base_model_path=llm.engine.config.model,
                                  data_dir=data_dir, num_layers=llm.engine.model_config.num_layers,
                                  max_model_len=256)
    return JobManager(store, llm.cluster.jobs, tokenizer or llm.get_tokenizer(), settings,
                      {name: t.limits for name, t in TENANTS.tenants.items()})


def _run(manager: JobManager, llm: LLM, iterations: int = 10_000, until: set[JobStatus] | None = None,
         store: MetadataStore | None = None, job_id: str = "") -> None:
    for _ in range(iterations):
        manager.reconcile()
        llm.step()
        manager.record_events()
        if until and store is not None and store.jobs.get("acme", job_id).status in until:
            return


def _create(service: FineTuningService, store: MetadataStore, **body: object) -> str:
    data = "\n".join(json.dumps(x) for x in LINES).encode()
    file = store.files.create("acme", "train.jsonl", "fine-tune", data)
    request = FineTuningJobCreate(model=BASE, training_file=file.id, seed=7, **body)
    return service.create("acme", request).id


@pytest.fixture
def store(tmp_path: Path) -> MetadataStore:
    store = MetadataStore(tmp_path / "data")
    store.models.ensure_base(BASE)
    return store


def test_a_job_trains_checkpoints_and_serves_its_models(llama_dir: Path, store: MetadataStore,
                                                        tmp_path: Path) -> None:
    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data")
    service = FineTuningService(store, TENANTS, (BASE,))
    job_id = _create(service, store, suffix="nums",
                     hyperparameters={"n_epochs": 2, "batch_size": 4}, lora={"r": 8})
    assert store.jobs.get("acme", job_id).status == JobStatus.VALIDATING_FILES
    _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=job_id)

    job = store.jobs.get("acme", job_id)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.fine_tuned_model == f"ft:{BASE}:acme:nums:{job_id[6:14]}"
    assert job.trained_tokens > 0 and job.hyperparameters["n_epochs"] == 2
    events, _ = store.events.page("acme", job_id, limit=100)
    metrics = [e for e in events if e.type == "metrics"]
    assert len(metrics) == 6 and {"step", "train_loss", "total_steps"} <= set(metrics[0].data)
    checkpoints, _ = store.checkpoints.page("acme", job_id)
    assert [c.step_number for c in checkpoints] == [6, 3]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-6"
    models = {m.id: m for m in store.models.usable("acme")}
    assert job.fine_tuned_model in models and checkpoints[1].fine_tuned_model_checkpoint in models
    assert not any(m.id.startswith("ft:") for m in store.models.usable("globex"))
    # Servable at once by the same engine.
    out = llm.generate("Say the number 3", SamplingParams(temperature=0, max_tokens=6),
                       lora_request=LoRARequest("ft", 5, models[job.fine_tuned_model].adapter_path))
    assert len(out[0].outputs[0].token_ids) == 6



def test_a_job_the_engine_refuses_fails_with_the_reason(llama_dir: Path, store: MetadataStore,
                                                       tmp_path: Path) -> None:
    # A gateway that does not know the engine's max_lora_rank (16 here) lets the job through; the
    # engine's refusal becomes the job's error, and the engine goes on.
    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data")
    job_id = _create(FineTuningService(store, TENANTS, (BASE,)), store, lora={"r": 32},
                     hyperparameters={"n_epochs": 1, "batch_size": 4})
    _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=job_id)
    job = store.jobs.get("acme", job_id)
    assert job.status == JobStatus.FAILED and job.error is not None and job.error["code"] == "invalid_job"
    assert "max_lora_rank" in job.error["message"] and "32" in job.error["message"]
    out = llm.generate("Say the number 3", SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_job_whose_starting_model_is_deleted_fails_naming_the_model(llama_dir: Path, store: MetadataStore,
                                                                      tmp_path: Path) -> None:
    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data")
    service = FineTuningService(store, TENANTS, (BASE,))
    first = _create(service, store, hyperparameters={"n_epochs": 1, "batch_size": 4}, lora={"r": 4})
    _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=first)
    model = store.jobs.get("acme", first).fine_tuned_model
    assert model is not None
    data = "\n".join(json.dumps(x) for x in LINES).encode()
    file = store.files.create("acme", "train.jsonl", "fine-tune", data)
    second = service.create("acme", FineTuningJobCreate(model=model, training_file=file.id)).id
    assert store.models.delete("acme", model)  # deleted after the job was accepted
    _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=second)
    job = store.jobs.get("acme", second)
    assert job.status == JobStatus.FAILED and job.error is not None
    assert (job.error["code"], job.error["param"]) == ("model_not_available", "model")
    assert model in job.error["message"]

def test_pause_resume_cancel_and_bad_requests(llama_dir: Path, store: MetadataStore,
                                              tmp_path: Path) -> None:
    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data")
    service = FineTuningService(store, TENANTS, (BASE,))
    job_id = _create(service, store, hyperparameters={"n_epochs": 30, "batch_size": 2})
    _run(manager, llm, until={JobStatus.RUNNING}, store=store, job_id=job_id)
    _run(manager, llm, iterations=30)
    service.pause("acme", job_id)
    _run(manager, llm, iterations=3)
    tokens = llm.cluster.jobs.get(job_id).position
    _run(manager, llm, iterations=30)
    assert llm.cluster.jobs.get(job_id).position == tokens  # no progress while paused
    assert not llm.engine.training.sequences  # the sequence in flight was dropped
    service.resume("acme", job_id)
    _run(manager, llm, iterations=20)
    assert llm.cluster.jobs.get(job_id).position != tokens
    assert store.jobs.get("acme", job_id).status == JobStatus.RUNNING

    # A second job fills acme's limit of two; a third is refused with 429.
    second = _create(service, store)
    with pytest.raises(ProtocolError) as err:
        _create(service, store)
    assert err.value.status == 429 and err.value.headers["retry-after"]
    service.cancel("acme", second)
    service.cancel("acme", job_id)
    _run(manager, llm, iterations=3)
    assert store.jobs.get("acme", job_id).status == JobStatus.CANCELLED
    assert not llm.engine.training.jobs and llm.policy.kv.num_free_blocks == llm.policy.kv.num_blocks
    with pytest.raises(ProtocolError, match="cancelled"):
        service.resume("acme", job_id)
    with pytest.raises(ProtocolError) as err:
        service.retrieve("globex", job_id)
    assert err.value.status == 404
    with pytest.raises(ProtocolError, match="at least 10") as err:
        file = store.files.create("acme", "t.jsonl", "fine-tune",
                                  "\n".join(json.dumps(x) for x in LINES[:5]).encode())
        service.create("acme", FineTuningJobCreate(model=BASE, training_file=file.id))
    assert err.value.param == "training_file"
    with pytest.raises(ProtocolError) as err:
        service.create("acme", FineTuningJobCreate(model="ft:other", training_file=file.id))
    assert err.value.param == "model"


@pytest.mark.parametrize("counted", [True, False], ids=["checkpoint-with-count", "older-checkpoint"])
def test_a_restarted_scheduler_resumes_to_the_uninterrupted_adapter(llama_dir: Path, tmp_path: Path,
                                                                     counted: bool) -> None:
    # ... and to its history: trained_tokens continues from the checkpoint's count (never going back),
    # and the metrics of the steps redone after the checkpoint are stored once. A checkpoint written
    # before the count was kept (`counted` False) resumes with the count its position implies.
    finals, tokens, steps = [], [], []
    for restart in (False, True):
        store = MetadataStore(tmp_path / f"data{restart}")
        store.models.ensure_base(BASE)
        service = FineTuningService(store, TENANTS, (BASE,))
        llm = _llm(llama_dir)
        manager = _manager(store, llm, tmp_path / f"data{restart}")
        job_id = _create(service, store, hyperparameters={"n_epochs": 2, "batch_size": 4})
        if restart:  # run past the first epoch's checkpoint, then lose the scheduler and engine
            while not store.checkpoints.page("acme", job_id)[0]:
                _run(manager, llm, iterations=1)
            checkpoint = store.checkpoints.page("acme", job_id)[0][0].step_number
            while _metric_steps(store, job_id)[-1] <= checkpoint:  # a step the resume redoes is stored
                _run(manager, llm, iterations=1)
            assert store.jobs.get("acme", job_id).status == JobStatus.RUNNING
            before = store.jobs.get("acme", job_id).trained_tokens
            state_file = Path(store.checkpoints.page("acme", job_id)[0][0].adapter_path) / STATE_FILE
            state = json.loads(state_file.read_text())
            assert 0 < state.pop("trained_tokens") < before
            if not counted:
                state_file.write_text(json.dumps(state))
            llm = _llm(llama_dir)
            manager = _manager(store, llm, tmp_path / f"data{restart}")
            while store.jobs.get("acme", job_id).status == JobStatus.RUNNING:
                _run(manager, llm, iterations=1)
                assert store.jobs.get("acme", job_id).trained_tokens >= before
        _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=job_id)
        job = store.jobs.get("acme", job_id)
        tokens.append(job.trained_tokens)
        steps.append(_metric_steps(store, job_id))
        assert job.status == JobStatus.SUCCEEDED, job.error
        path = store.models.get("acme", job.fine_tuned_model).adapter_path
        finals.append(load_file(str(Path(path) / "adapter_model.safetensors")))
        events, _ = store.events.page("acme", job_id, limit=100)
        assert restart == any("Resumed" in e.message for e in events)
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert tokens[0] == tokens[1] > 0
    assert steps[0] == steps[1] == list(range(1, 7))  # 12 examples / 4 x 2 epochs, each step once


def _metric_steps(store: MetadataStore, job_id: str) -> list[int]:
    """The steps of the job's training-metrics events, oldest first (repeats kept)."""
    events, _ = store.events.page("acme", job_id, limit=1000)
    return sorted(e.data["step"] for e in events if e.type == "metrics" and "train_loss" in e.data
                  and "valid_loss" not in e.data)


def test_lora_settings_the_trainer_cannot_honour_are_refused_at_creation(store: MetadataStore) -> None:
    service = FineTuningService(store, TENANTS, (BASE,))
    for lora, param in (({"lora_dropout": 0.1}, "lora.lora_dropout"),
                        ({"target_modules": ["fc1"]}, "lora.target_modules")):
        with pytest.raises(ProtocolError) as err:
            _create(service, store, lora=lora)
        assert err.value.status == 400 and err.value.param == param


def test_a_job_row_written_before_the_typed_settings_loads(llama_dir: Path, store: MetadataStore,
                                                          tmp_path: Path) -> None:
    """A row as older gateways stored it (the request's partial PEFT dict, nulls and unsorted
    modules included; hyperparameters with "auto") becomes the typed settings of the job's spec."""
    from coserve.contract.training_settings import LoRASettings, OptimizerSettings

    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data")
    data = "\n".join(json.dumps(x) for x in LINES).encode()
    file = store.files.create("acme", "train.jsonl", "fine-tune", data)
    record = store.jobs.create("acme", BASE, file.id, seed=3,
                               hyperparameters={"n_epochs": 1, "batch_size": "auto",
                                                "learning_rate_multiplier": 2.0},
                               extensions={"lora": {"r": 4, "lora_alpha": None,
                                                    "target_modules": ["v_proj", "q_proj"]}})
    assert manager.collect({}) == []  # validated: queued
    [intent] = manager.collect({})
    spec = intent.prepared.spec
    assert spec.lora == LoRASettings(r=4, target_modules=("q_proj", "v_proj"))
    assert spec.optimizer == OptimizerSettings(learning_rate_multiplier=2.0)
    assert store.jobs.get("acme", record.id).extensions["lora"]["lora_alpha"] is None  # row unchanged


# ---------------------------------------------------------------------- a job's failure is the job's (issue 45)

class _Poisoned:
    """The job manager's real tokenizer, except on a conversation that holds `POISON`: it raises `error` like
    a library bug would, after waiting for `release` when one is given (a file that takes long to tokenize)."""

    def __init__(self, tokenizer: Any, error: Exception | None = None, release: threading.Event | None = None) -> None:
        self._tokenizer, self._error, self._release = tokenizer, error, release
        self.waiting = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, conversation: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        if any("POISON" in str(message.get("content")) for message in conversation):
            if self._release is not None:
                self.waiting.set()
                assert self._release.wait(60)
            if self._error is not None:
                raise self._error
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)


def _stored_job(store: MetadataStore, tenant: str, data: bytes, **fields: Any) -> str:
    """A job over a file stored as it is, as before uploads refused it (the store takes any bytes)."""
    file = store.files.create(tenant, "train.jsonl", "fine-tune", data)
    return store.jobs.create(tenant, BASE, file.id, hyperparameters={"n_epochs": 1, "batch_size": 4}, **fields).id


def _pair(i: int, text: str = "x") -> str:
    return json.dumps({"input": {"messages": [{"role": "user", "content": f"{text} {i}"}]},
                       "preferred_output": [{"role": "assistant", "content": "yes"}],
                       "non_preferred_output": [{"role": "assistant", "content": "no"}]})


def _chat_lines(poison: str = "") -> bytes:
    lines = [json.dumps(x) for x in LINES]
    if poison:
        lines[3] = json.dumps({"messages": [{"role": "user", "content": poison},
                                            {"role": "assistant", "content": "a"}]})
    return "\n".join(lines).encode()


def test_a_job_whose_preparation_raises_fails_alone_and_the_pass_goes_on(llama_dir: Path, store: MetadataStore,
                                                                      tmp_path: Path) -> None:
    """Files that make a job's preparation raise, whatever the exception: a DPO pair with a lone surrogate
    (the issue's case: TypeError out of the pass, every tenant's jobs stalled), a line nested 100,000 deep,
    and a library bug (RuntimeError). Each fails its own job with OpenAI's `error`, and in the same pass
    another tenant's running job is paused and a third cancelled; a job created after them succeeds."""
    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data", _Poisoned(llm.get_tokenizer(), RuntimeError("/srv/secret")))
    service = FineTuningService(store, TENANTS, (BASE,))
    paused = _create(service, store, hyperparameters={"n_epochs": 30, "batch_size": 2})
    _run(manager, llm, until={JobStatus.RUNNING}, store=store, job_id=paused)
    surrogate = "\n".join([_pair(0, "x\ud800"), *(_pair(i) for i in range(1, 12))]).encode()
    attacks = {
        _stored_job(store, "globex", surrogate, method={"type": "dpo"}): ("invalid_training_file", "lone surrogate"),
        _stored_job(store, "globex", _chat_lines() + b"\n" + b"[" * 100_000 + b"]" * 100_000):
            ("invalid_training_file", "line 13: nested deeper than 100 levels"),
        _stored_job(store, "globex", _chat_lines(poison="POISON")):
            ("internal_error", "an internal error (RuntimeError) stopped the job while validating its files"),
    }
    cancelled = _create(service, store, hyperparameters={"n_epochs": 30, "batch_size": 2})
    service.pause("acme", paused)
    service.cancel("acme", cancelled)
    manager.reconcile()  # one pass: the poisoned jobs fail, the pause and the cancel are applied
    for job_id, (code, text) in attacks.items():
        job = store.jobs.get("globex", job_id)
        assert job.status == JobStatus.FAILED and job.error is not None and job.error["code"] == code, job.error
        assert text in job.error["message"] and "/srv/secret" not in job.error["message"]
        events, _ = store.events.page("globex", job_id, limit=10)
        assert events[0].level == "error" and events[0].message == f"Job failed: {job.error['message']}"
    llm.step()
    assert llm.cluster.jobs.get(paused).state is JobState.PAUSED
    manager.record_events()
    assert store.jobs.get("acme", cancelled).status == JobStatus.CANCELLED

    victim = _create(service, store, hyperparameters={"n_epochs": 1, "batch_size": 4})
    _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=victim)
    job = store.jobs.get("acme", victim)
    assert job.status == JobStatus.SUCCEEDED and job.error is None


def test_a_checkpoint_unreadable_on_resume_fails_its_job_alone(llama_dir: Path, store: MetadataStore,
                                                               tmp_path: Path) -> None:
    """After a restart, a running job whose last checkpoint lost its state file (FileNotFoundError used to
    abort every pass) fails with `checkpoint_unreadable`; a job queued beside it runs to the end."""
    llm = _llm(llama_dir)
    manager = _manager(store, llm, tmp_path / "data")
    service = FineTuningService(store, TENANTS, (BASE,))
    broken = _create(service, store, hyperparameters={"n_epochs": 3, "batch_size": 4})
    while not store.checkpoints.page("acme", broken)[0]:
        _run(manager, llm, iterations=1)
    (Path(store.checkpoints.page("acme", broken)[0][0].adapter_path) / STATE_FILE).unlink()
    other = _create(service, store, hyperparameters={"n_epochs": 1, "batch_size": 4})
    llm = _llm(llama_dir)  # the restart: a new engine and manager over the same store
    manager = _manager(store, llm, tmp_path / "data")
    _run(manager, llm, until={JobStatus.SUCCEEDED, JobStatus.FAILED}, store=store, job_id=other)
    assert store.jobs.get("acme", other).status == JobStatus.SUCCEEDED
    error = store.jobs.get("acme", broken).error
    assert error is not None and error["code"] == "checkpoint_unreadable" and "FileNotFoundError" in error["message"]


def test_pauses_and_cancels_are_applied_while_a_big_file_is_prepared(llama_dir: Path, store: MetadataStore,
                                                                    tmp_path: Path) -> None:
    """The job loop (`JobManager.run`) prepares jobs beside its passes, one per tenant: while one tenant's
    file is still being tokenized, another tenant's job is prepared, started and paused, and a third job
    cancelled; when the big file is done, its job runs too."""
    llm = _llm(llama_dir)
    release = threading.Event()
    poisoned = _Poisoned(llm.get_tokenizer(), release=release)
    manager = _manager(store, llm, tmp_path / "data", poisoned)
    service = FineTuningService(store, TENANTS, (BASE,))
    slow = _stored_job(store, "globex", _chat_lines(poison="POISON is slow to tokenize"))
    victim = _create(service, store, hyperparameters={"n_epochs": 30, "batch_size": 2})
    cancelled = _create(service, store, hyperparameters={"n_epochs": 30, "batch_size": 2})
    status = lambda job_id, tenant="acme": store.jobs.get(tenant, job_id).status  # noqa: E731

    async def drive() -> None:
        loop = asyncio.create_task(manager.run(lambda: None, lambda: status(slow, "globex").is_terminal))
        steps = [(lambda: status(victim) == JobStatus.RUNNING and status(cancelled) == JobStatus.RUNNING,
                  lambda: (service.pause("acme", victim), service.cancel("acme", cancelled))),
                 (lambda: llm.cluster.jobs.get(victim).state is JobState.PAUSED
                  and llm.cluster.jobs.get(cancelled) is None,
                  release.set)]
        for _ in range(2000):
            llm.step()
            manager.record_events()
            if steps and steps[0][0]():
                assert poisoned.waiting.is_set() and not release.is_set()  # the big file is still being read
                steps.pop(0)[1]()
            await asyncio.sleep(0.01)
            if loop.done():
                break
        await loop
        assert not steps

    asyncio.run(drive())
    assert status(cancelled) == JobStatus.CANCELLED and status(victim) == JobStatus.PAUSED
    assert status(slow, "globex") == JobStatus.SUCCEEDED
