"""Fault isolation in the engine step, on coserve's real engine (tiny llama, fp32, CPU): a fault caused by one
tenant's work fails that work alone, with its own error, and everyone co-batched with it completes as if
the fault had not happened.

The fault is injected into the real forward: it runs whole (K/V written, the windows' layer inputs kept)
and then raises IndexError when a poisoned token is in the batch, the worst case for the engine's promise
that a `PlanFault` leaves it as if the fused part had not run. The scheduler (`FaultIsolation`) retries
the plan's pieces apart. The victims' greedy tokens and the co-batched job's trained weights are compared
with a run without the fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cluster_sim import builder, config
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.fault_isolation import FaultIsolation, retry_limit
from coserve.contract.engine_config import EngineConfig
from coserve.contract.job_spec import FinetuneJobSpec, JobEventKind
from coserve.contract.sampling import SamplingParams
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import LoRASettings
from coserve.finetune.driven_ops import driven_calls
from coserve.inference.request import Request, RequestStatus
from coserve.planner.share_kinds import ShareKind
from coserve.torch_engine.engine import TorchEngine

POISON = 7  # the attacker's token: the injected fault fires when it is in a forward's batch
BS = 4


def _engine(model: Path) -> TorchEngine:
    return TorchEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=96, block_size=BS,
                                    max_loras=2, max_lora_rank=8))


@contextmanager
def poisoned(engine: TorchEngine, token: int = POISON) -> Iterator[list[int]]:
    """The engine's forward raises IndexError (as an out-of-vocabulary id does) after it ran whole, when
    `token` is in the batch; yields the sizes of the batches it failed."""
    real, failed = engine.model.forward, []

    def forward(batch: Any, *args: Any) -> torch.Tensor:
        hidden = real(batch, *args)
        if bool((batch.token_ids == token).any()):
            failed.append(int(batch.token_ids.numel()))
            raise IndexError("index out of range in self")
        return hidden

    engine.model.forward = forward  # type: ignore[method-assign]
    try:
        yield failed
    finally:
        engine.model.forward = real  # type: ignore[method-assign]


def _job(tmp: Path, name: str, num_layers: int, poison: bool = False) -> FinetuneJobSpec:
    g = torch.Generator().manual_seed(3)
    examples = []
    for n in (14, 11, 17, 9):
        ids = torch.randint(100, 250, (n,), generator=g).tolist()
        if poison:
            ids[n // 2] = POISON
        examples.append(TrainingExample(ids, [False] * 3 + [True] * (n - 3)))
    return FinetuneJobSpec(job_id=name, tenant="trainer", adapter_id=90, examples=examples, n_epochs=1,
                           batch_size=2, seed=5, num_layers=num_layers, output_dir=str(tmp / name),
                           lora=LoRASettings(r=4, lora_alpha=8), min_tasklet_tokens=1)


def _request(request_id: str, tenant: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   tenant=tenant)


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request -> its output tokens
    status: dict[str, RequestStatus] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)  # request or job -> its fault
    events: list[Any] = field(default_factory=list)
    retries: int = 0


def _serve(engine: TorchEngine, tmp: Path, requests: list[Request], job: FinetuneJobSpec) -> Run:
    """Requests of two tenants and a fine-tuning job on one engine under a static split (every iteration
    holds both), until all end."""
    cfg = config(scheduler={"max_model_len": 64, "max_batch_tokens": 48, "max_num_seqs": 8},
                 tpot_slo_ms=1000.0)
    c = EngineCluster()
    c.add_engine("e0", builder(cfg, num_blocks=engine.layout.num_kv_blocks, kind=ShareKind.STATIC_SPLIT))
    c.jobs.start(job)
    for request in requests:
        c.submit(request)
    run = Run()
    for _ in range(400):
        if not c.has_unfinished() and not c.jobs.job_ids:
            break
        step = c.step("e0", engine)
        run.retries += step.retries
        run.faults.update({f.request_id: f.message for f in step.result.faults})
        run.faults.update({f.job_id: f.message for f in step.result.training.faults})
        run.events += c.jobs.pop_events()
    else:
        raise AssertionError("the engine did not finish its work")
    for request in requests:
        run.tokens[request.request_id] = list(request.output_token_ids)
        run.status[request.request_id] = request.status
    return run


def _victims() -> list[Request]:
    return [_request(f"v{i}", "victim", list(range(20 + 3 * i, 31 + 3 * i))) for i in range(3)]


def _adapter(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp / name / "final" / "adapter_model.safetensors"))


def test_a_poisoned_request_fails_alone_and_its_batch_completes_as_without_it(llama_dir: Path,
                                                                           tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    layers = engine.model_config.num_layers
    attacker = [50, 51, POISON, 52, 53, 54]
    clean = _serve(engine, tmp_path / "clean", [*_victims(), _request("evil", "attacker", attacker)],
                   _job(tmp_path / "clean", "job", layers))
    with poisoned(engine) as failed:
        faulted = _serve(engine, tmp_path / "faulted", [*_victims(), _request("evil", "attacker", attacker)],
                         _job(tmp_path / "faulted", "job", layers))
    assert failed, "the fault never fired"
    # The attacker's request fails alone, with its own error (no path, no other tenant's text).
    assert faulted.status["evil"] is RequestStatus.FINISHED_ABORTED and faulted.tokens["evil"] == []
    assert faulted.faults == {"evil": "IndexError: index out of range in self"}
    # Everyone else: the tokens of a run without the fault, greedy, token for token; the job's weights.
    for request_id in ("v0", "v1", "v2"):
        assert faulted.status[request_id] is RequestStatus.FINISHED_LENGTH_CAPPED
        assert faulted.tokens[request_id] == clean.tokens[request_id] and len(clean.tokens[request_id]) == 8
    assert [e.kind for e in faulted.events if e.kind is JobEventKind.SUCCEEDED] == [JobEventKind.SUCCEEDED]
    want, got = _adapter(tmp_path / "clean", "job"), _adapter(tmp_path / "faulted", "job")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7)
    # Bounded: one failing batch of 5 pieces (3 victims, the attacker, the job).
    assert len(failed) <= 1 + retry_limit(5) and 0 < faulted.retries <= retry_limit(5)


def test_a_poisoned_job_fails_alone_and_the_requests_beside_it_complete(llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(llama_dir)
    layers = engine.model_config.num_layers
    clean = _serve(engine, tmp_path / "clean", _victims(), _job(tmp_path / "clean", "job", layers))
    with poisoned(engine) as failed:
        faulted = _serve(engine, tmp_path / "faulted", _victims(),
                         _job(tmp_path / "faulted", "bad", layers, poison=True))
    assert failed
    assert faulted.faults == {"bad": "IndexError: index out of range in self"}
    (end,) = [e for e in faulted.events if e.kind in (JobEventKind.FAILED, JobEventKind.SUCCEEDED)]
    assert end.kind is JobEventKind.FAILED and end.code == "engine_error"
    assert end.message == "the engine could not run the job's work: IndexError: index out of range in self"
    for request_id in ("v0", "v1", "v2"):
        assert faulted.tokens[request_id] == clean.tokens[request_id]
    assert not engine.training.jobs and not engine.training.sequences  # the failed job's state is gone


def test_out_of_vocabulary_ids_fail_their_request_alone_in_the_engine(llama_dir: Path, tmp_path: Path) -> None:
    """Ids past the vocabulary that got below the edge's checks: the engine refuses them where it takes the
    request (no forward runs them: on a GPU their embedding would be a device-side assert)."""
    engine = _engine(llama_dir)
    layers, vocab = engine.model_config.num_layers, engine.model_config.vocab_size
    clean = _serve(engine, tmp_path / "clean", _victims(), _job(tmp_path / "clean", "job", layers))
    faulted = _serve(engine, tmp_path / "faulted", [*_victims(), _request("evil", "attacker", [5, vocab + 9, 6])],
                     _job(tmp_path / "faulted", "job", layers))
    assert faulted.faults == {"evil": f"ValueError: token id {vocab + 9} is outside the model's vocabulary "
                                      f"(0..{vocab - 1})"}
    assert faulted.retries == 0  # told apart by the engine itself: nothing to retry
    for request_id in ("v0", "v1", "v2"):
        assert faulted.tokens[request_id] == clean.tokens[request_id]


def test_isolation_needs_about_two_log2_retries_per_culprit() -> None:
    """The retries of a plan of n requests with one culprit, on the pure-Python side."""
    from coserve.contract.engine import EngineFailure
    from coserve.contract.plan import IterationPlan, IterationResult, ScheduledChunk

    for n, culprit in ((2, 1), (8, 5), (64, 0), (64, 63), (100, 37)):
        chunks = [ScheduledChunk(f"r{i}", 0, 1, [i], True) for i in range(n)]
        isolation = FaultIsolation(IterationPlan(step_id=3, chunks=chunks), "boom")
        while (sub := isolation.next_plan()) is not None:
            ids = {c.request_id for c in sub.chunks}
            isolation.record(EngineFailure(3, f"bad {culprit}", isolatable=True) if f"r{culprit}" in ids
                             else IterationResult(step_id=3))
        assert [(p.key, m) for p, m in isolation.culprits] == [(f"r{culprit}", f"bad {culprit}")]
        assert isolation.retries <= 2 * (n - 1).bit_length(), (n, isolation.retries)
        assert not isolation.engine_broken


@pytest.mark.parametrize("n", [2, 5, 16])
def test_a_fault_that_follows_every_piece_is_reported_generically(n: int) -> None:
    """Every piece fails alone (the engine fails whatever it runs): nobody gets the engine's text."""
    from coserve.cluster.fault_isolation import GENERIC_FAULT
    from coserve.contract.engine import EngineFailure
    from coserve.contract.plan import IterationPlan, ScheduledChunk

    chunks = [ScheduledChunk(f"r{i}", 0, 1, [i], True) for i in range(n)]
    isolation = FaultIsolation(IterationPlan(step_id=0, chunks=chunks), "CUDA error: an illegal memory access")
    while isolation.next_plan() is not None:
        isolation.record(EngineFailure(0, "CUDA error: an illegal memory access", isolatable=True))
    assert isolation.engine_broken
    assert {f.message for f in isolation.result().faults} == {GENERIC_FAULT}
    assert len(isolation.result().faults) == n and isolation.retries <= retry_limit(n)


def _driven_run(engine: TorchEngine, tmp: Path, calls: list[Any]) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """A driven run (Tinker's) on one engine: its calls one after the other, then a sampler save; returns the
    calls' outcomes and the saved weights. Calls go to the job as the run's own queue hands them over, so
    what the edge checks does not apply (the engine is the line of defence here)."""
    from coserve.contract.training_calls import SaveCall
    from coserve.finetune.driven_ops import DrivenOp

    cfg = config(scheduler={"max_model_len": 64, "max_batch_tokens": 48, "max_num_seqs": 8}, tpot_slo_ms=1000.0)
    c = EngineCluster()
    c.add_engine("e0", builder(cfg, num_blocks=engine.layout.num_kv_blocks, kind=ShareKind.STATIC_SPLIT))
    spec = FinetuneJobSpec(job_id="run", tenant="attacker", adapter_id=91, examples=[], n_epochs=1, batch_size=1,
                           seed=5, num_layers=engine.model_config.num_layers, output_dir=str(tmp),
                           lora=LoRASettings(r=4, lora_alpha=8), min_tasklet_tokens=1, driven=True)
    c.jobs.start(spec)
    job = c.jobs.get("run")
    queue = None if job is None else driven_calls(job.source)
    assert queue is not None
    ops = [DrivenOp(f"c{i}", call, 0.0) for i, call in enumerate([*calls, SaveCall("w", resumable=False)])]
    for op in ops:
        queue.submit(op)
        c.jobs.work_arrived("run")
        for _ in range(200):
            if op.done:
                break
            c.step("e0", engine)
        assert op.done, op.call_id
    return [op.outcome for op in ops], load_file(str(tmp / "sampler_weights" / "w" / "adapter_model.safetensors"))


def test_a_driven_call_with_out_of_vocabulary_ids_fails_alone_and_leaves_no_gradient(llama_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """The issue's case below the edge: a forward_backward whose second datum has ids past the vocabulary,
    after its first datum trained. The call fails with its own error; the run's next calls train as if it
    had never been made (the gradient before the call is put back), and the run is not wedged."""
    from coserve.contract.loss_spec import LossSpec, TokenInputs
    from coserve.contract.training_calls import (
        CallFailure,
        ForwardBackwardCall,
        ForwardBackwardOutcome,
        OptimStepCall,
        TrainingDatum,
    )
    from coserve.contract.training_settings import AdamStep

    engine = _engine(llama_dir)
    vocab = engine.model_config.vocab_size

    def fb(*data: list[int]) -> ForwardBackwardCall:
        return ForwardBackwardCall([TrainingDatum(ids, TokenInputs()) for ids in data], LossSpec())

    good, other = list(range(100, 130)), list(range(140, 160))
    step = OptimStepCall(AdamStep(learning_rate=5e-2))
    clean, want = _driven_run(engine, tmp_path / "clean", [fb(good), fb(other), step])
    hit, got = _driven_run(engine, tmp_path / "hit", [fb(good), fb(other, [5, 6, vocab + 11, 7]), fb(other), step])
    assert isinstance(hit[1], CallFailure) and hit[1].code == "engine_error" and hit[1].user
    assert hit[1].message == (f"the engine could not run this call: ValueError: token id {vocab + 11} is outside "
                              f"the model's vocabulary (0..{vocab - 1})")
    assert all(isinstance(o, ForwardBackwardOutcome) for o in (hit[0], hit[2], clean[0], clean[1]))
    assert hit[2].loss_sum == pytest.approx(clean[1].loss_sum, rel=1e-6)  # type: ignore[union-attr]
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7)
    assert not engine.training.sequences  # the failed call's sequences are gone from the engine
