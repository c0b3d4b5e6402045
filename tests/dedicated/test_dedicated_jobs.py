"""Dedicated jobs in the scheduler's `JobManager`, between a real SQLite store and real Ray Train runs (2 CPU
workers, the package's cluster): the operator's threshold routes a big job to Ray Train, it pauses, a job
that cannot get its workers meanwhile says why in its events and is cancelled at once, and a restarted
scheduler resumes the first job from its last checkpoint to the end, its counters and events as if nothing
happened. Queued runs are told their place; a run paused past the pause timeout gives its workers back
and its job resumes from the checkpoint it saved."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coserve import LLM
from coserve.api.protocol.fine_tuning import FineTuningJobCreate, TrainingParams
from coserve.api.serving.fine_tuning import FineTuningService
from coserve.dedicated.capacity import ClusterCapacity
from coserve.finetune.dedicated import DedicatedSettings
from coserve.jobs.dedicated_jobs import DedicatedJobs
from coserve.jobs.manager import FineTuningSettings, JobManager
from coserve.store import MetadataStore
from coserve.store.records import JobStatus
from coserve.tenancy.tenants import parse_tenants

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BASE = "tiny-llama"
LINES = [{"messages": [{"role": "user", "content": f"Say the number {i}"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]
TENANTS = parse_tenants({"tenants": {"acme": {"api_keys": ["sk-acme"]}}})
THRESHOLD = 200  # trained tokens: the 12 lines x EPOCHS are over it
EPOCHS = 8  # 24 steps: the run is still going when it is paused after its first checkpoint


def _manager(store: MetadataStore, llm: LLM, data_dir: Path, dedicated: DedicatedSettings) -> JobManager:
    settings = FineTuningSettings(base_model_id=BASE, base_model_path=llm.engine.config.model, data_dir=data_dir,
                                  num_layers=llm.engine.model_config.num_layers, max_model_len=256,
                                  stall_after_s=1.0, dedicated=dedicated)
    return JobManager(store, llm.cluster.jobs, llm.get_tokenizer(), settings,
                      dedicated=DedicatedJobs(dedicated, store, llm.engine.config.model, data_dir))


def _drive(manager: JobManager, until: Callable[[], bool], timeout: float = 300) -> None:
    """The scheduler's job loop (`JobManager.run`) until `until()` holds."""
    deadline = time.monotonic() + timeout

    def stopped() -> bool:
        assert time.monotonic() < deadline, "the job loop did not get there in time"
        return until()

    asyncio.run(manager.run(lambda: None, stopped))


def _create(service: FineTuningService, store: MetadataStore, **body: object) -> str:
    file = store.files.create("acme", "train.jsonl", "fine-tune", "\n".join(json.dumps(x) for x in LINES).encode())
    return service.create("acme", FineTuningJobCreate(model=BASE, training_file=file.id, seed=5, **body)).id


def _messages(store: MetadataStore, job_id: str) -> list[str]:
    events, _ = store.events.page("acme", job_id, limit=100)
    return [e.message for e in reversed(events)]


def test_routing_waiting_cancel_and_restart(ray_cluster: None, llama_dir: Path, tmp_path: Path) -> None:
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table

    data_dir = tmp_path / "data"
    store = MetadataStore(data_dir)
    store.models.ensure_base(BASE)
    llm = LLM(str(llama_dir), dtype="float32", max_batch_tokens=64, num_kv_blocks=96, block_size=8,
              max_model_len=256, max_lora_rank=16)
    dedicated = DedicatedSettings(min_trained_tokens=THRESHOLD, default_workers=2, dtype="float32")
    service = FineTuningService(store, TENANTS, (BASE,), dedicated=ClusterCapacity(dedicated))
    big = _create(service, store, hyperparameters={"n_epochs": EPOCHS, "batch_size": 4})  # 3 steps an epoch
    first = _manager(store, llm, data_dir, dedicated)
    _drive(first, lambda: bool(store.checkpoints.page("acme", big)[0]))
    record = store.jobs.get("acme", big)
    assert record.status == JobStatus.RUNNING and record.extensions["training"] == {"mode": "dedicated", "workers": 2}
    assert any(m.startswith("Routed to a dedicated Ray Train run on 2 worker(s): ") and
               f">= the server's dedicated threshold of {THRESHOLD}" in m for m in _messages(store, big))
    # Paused: its workers wait at a step boundary and keep their CPUs (the run goes on without the job loop).
    service.pause("acme", big)
    _drive(first, lambda: any(m.startswith("Paused at step") for m in _messages(store, big)))
    assert store.jobs.get("acme", big).status == JobStatus.PAUSED

    # A second dedicated job cannot get its 2 CPUs while the first holds them: it waits and says why, at
    # once and again when the watchdog finds it has not moved.
    waiting = _create(service, store, training=TrainingParams(mode="dedicated"))
    _drive(first, lambda: any(m.startswith("No progress for") for m in _messages(store, waiting)))
    why = "aiting for 2 free worker(s) of {'CPU': 1.0}: the cluster has {'CPU': 2.0}, {'CPU': 0.0} of it free"
    messages = _messages(store, waiting)
    assert any(m.startswith("W" + why) for m in messages) and any(
        m.startswith("No progress for") and why in m for m in messages), messages
    service.cancel("acme", waiting)
    _drive(first, lambda: "Fine-tuning job cancelled" in _messages(store, waiting))
    assert store.jobs.get("acme", waiting).status == JobStatus.CANCELLED

    # The scheduler restarts: its process ends (the run's actor with it), a new job manager takes over. The
    # dead run's placement group outlives it (this cluster has no state API for Ray Train's own cleaner):
    # the job's next run removes it, or it would wait for its 2 CPUs forever.
    ray.kill(ray.get_actor(f"coserve-dedicated-{big}", namespace="coserve"))
    group = PlacementGroup(ray.PlacementGroupID.from_hex(store.jobs.get("acme", big).extensions["ray_placement_group"]))
    assert placement_group_table(group)["state"] == "CREATED"
    second = _manager(store, llm, data_dir, dedicated)
    service.resume("acme", big)  # queued again: the new job manager starts it from its last checkpoint
    _drive(second, lambda: store.jobs.get("acme", big).status.is_terminal)
    assert placement_group_table(group)["state"] == "REMOVED"
    record = store.jobs.get("acme", big)
    assert record.status == JobStatus.SUCCEEDED, record.error
    messages = _messages(store, big)
    assert "Resumed from the last checkpoint" in messages, messages
    events, _ = store.events.page("acme", big, limit=100)
    steps = [e.data["step"] for e in reversed(events) if e.type == "metrics"]
    assert steps == list(range(1, 3 * EPOCHS + 1)), steps  # once per step: redone steps are not stored again
    assert [c.step_number for c in store.checkpoints.page("acme", big, limit=100)[0]] == \
        list(range(3 * EPOCHS, 0, -3))
    assert record.trained_tokens == EPOCHS * _trained_tokens_per_epoch(llm)
    runs = sorted(p.name for p in (data_dir / "adapters" / big).glob("run-*"))
    assert runs == ["run-1", "run-2"]  # each attempt is a fresh Ray Train run folder
    assert record.fine_tuned_model in {m.id for m in store.models.usable("acme")}


PAUSE_TIMEOUT_S = 5.0  # long enough for the jobs behind to queue first, short for the test


def test_queued_runs_know_their_place_and_a_paused_run_gives_its_workers_back(
        ray_cluster: None, llama_dir: Path, tmp_path: Path) -> None:
    """Three dedicated jobs of 2 workers on the 2-CPU cluster. The first trains and is paused; the two
    behind it are told their places. Paused past the timeout, the first run saves a checkpoint at its step
    boundary and gives its workers back: the second launches and the third moves up. Resumed, the first
    job starts a new run from that checkpoint and finishes, every step's metrics stored once."""
    data_dir = tmp_path / "data"
    store = MetadataStore(data_dir)
    store.models.ensure_base(BASE)
    llm = LLM(str(llama_dir), dtype="float32", max_batch_tokens=64, num_kv_blocks=96, block_size=8,
              max_model_len=256, max_lora_rank=16)
    dedicated = DedicatedSettings(default_workers=2, dtype="float32", pause_timeout_s=PAUSE_TIMEOUT_S)
    service = FineTuningService(store, TENANTS, (BASE,), dedicated=ClusterCapacity(dedicated))
    manager = _manager(store, llm, data_dir, dedicated)
    mode = TrainingParams(mode="dedicated")
    first = _create(service, store, hyperparameters={"n_epochs": EPOCHS, "batch_size": 4}, training=mode)
    _drive(manager, lambda: bool(store.checkpoints.page("acme", first)[0]))
    service.pause("acme", first)
    second, third = _create(service, store, training=mode), _create(service, store, training=mode)
    _drive(manager, lambda: "Queued for a dedicated run: position 2 of 2" in _messages(store, third))
    assert any(m.startswith("Queued for a dedicated run: position 1 of ") for m in _messages(store, second))

    released = re.compile(rf"^Paused for {PAUSE_TIMEOUT_S:g} s: the Ray Train run gave its 2 worker\(s\) back; "
                          r"resuming the job restarts it from its checkpoint at step (\d+)$")
    _drive(manager, lambda: any(released.match(m) for m in _messages(store, first)))
    step = int(next(m for m in map(released.match, _messages(store, first)) if m).group(1))
    assert step in {c.step_number for c in store.checkpoints.page("acme", first, limit=100)[0]}
    _drive(manager, lambda: "Queued for a dedicated run: position 1 of 1" in _messages(store, third))  # 2nd runs
    assert any(m.startswith("No progress for") and "queued for a dedicated run: position 2 of 2, behind 1 run(s)"
               in m for m in _messages(store, third))  # the watchdog says why, too
    service.cancel("acme", third)
    service.cancel("acme", second)
    _drive(manager, lambda: all("Fine-tuning job cancelled" in _messages(store, j) for j in (second, third)))

    service.resume("acme", first)
    _drive(manager, lambda: store.jobs.get("acme", first).status.is_terminal)
    record = store.jobs.get("acme", first)
    assert record.status == JobStatus.SUCCEEDED, record.error
    messages = _messages(store, first)
    assert "Resumed from the last checkpoint" in messages
    assert any(m.startswith(f"Ray Train started 2 worker(s) (gloo) from its checkpoint at step {step}:")
               for m in messages), messages
    events, _ = store.events.page("acme", first, limit=100)
    assert [e.data["step"] for e in reversed(events) if e.type == "metrics"] == list(range(1, 3 * EPOCHS + 1))
    assert record.trained_tokens == EPOCHS * _trained_tokens_per_epoch(llm)
    assert sorted(p.name for p in (data_dir / "adapters" / first).glob("run-*")) == ["run-1", "run-2"]


def _trained_tokens_per_epoch(llm: LLM) -> int:
    from trainer_data import prepare_dataset

    return prepare_dataset(llm.get_tokenizer(), LINES, 256).trained_tokens



def test_the_cluster_capacity_refuses_what_it_can_never_place(ray_cluster: None) -> None:
    from coserve.dedicated.capacity import ClusterTooSmall

    capacity = ClusterCapacity(DedicatedSettings(min_trained_tokens=1, default_workers=3))
    assert capacity.refusal(2) is None
    assert capacity.refusal(3) == ("training.workers=3 is more than this Ray cluster can run at once: at most "
                                   "2 worker(s) of {'CPU': 1.0} (the cluster has {'CPU': 2.0})")
    with pytest.raises(ClusterTooSmall, match=r"^--dedicated-workers 3 is more than this Ray cluster"):
        capacity.check_default()  # `coserve serve` stops with this rather than routing jobs that would hang
    ClusterCapacity(DedicatedSettings(default_workers=3)).check_default()  # nothing routed: nothing to check
    gpus = ClusterCapacity(DedicatedSettings(use_gpu=True), {"GPU": 1.0}).refusal(1)
    assert gpus is not None and "at most 0 worker(s) of {'CPU': 1.0, 'GPU': 1.0}" in gpus
    assert gpus.endswith("less {'GPU': 1.0} the serving actors hold")
