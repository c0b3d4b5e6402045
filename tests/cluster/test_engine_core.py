"""EngineCore against a fake engine that implements the `Engine` protocol: pure Python, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coserve.cluster.engine_core import EngineCore, PlanInFlight, PlanMismatch, StepFailed
from coserve.contract.engine import Engine, EngineFailure, RuntimeLayout
from coserve.contract.plan import IterationPlan, IterationResult, SampledToken, TokenLogprobs
from coserve.contract.sampling import SamplingParams
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.planner import InferencePlanner
from coserve.inference.request import Request, RequestStatus
from coserve.inference.scheduler_config import SchedulerConfig

TOKEN = 7
LAYOUT = RuntimeLayout(num_kv_blocks=64, block_size=4, max_model_len=64, vocab_size=100,
                       num_adapter_slots=2, max_lora_rank=8)


class FakeEngine:
    """Samples TOKEN (with its logprob) for every sampled chunk; logs each step; can be told to fail."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.log = log if log is not None else []
        self.fail: Exception | None = None
        self.steps: list[int] = []

    @property
    def layout(self) -> RuntimeLayout:
        return LAYOUT

    def step(self, plan: IterationPlan) -> IterationResult:
        self.log.append(f"step {plan.step_id}")
        if self.fail is not None:
            raise self.fail
        self.steps.append(plan.step_id)
        return answer(plan)


def answer(plan: IterationPlan) -> IterationResult:
    lp = TokenLogprobs(TOKEN, -0.5, 1, [TOKEN], [-0.5])
    return IterationResult(step_id=plan.step_id, num_tokens=plan.num_tokens,
                           sampled=[SampledToken(c.request_id, TOKEN, lp) for c in plan.chunks if c.sample])


class LoggingSource:
    """A policy stand-in: one non-empty plan per call (or empty ones when told), logged."""

    def __init__(self, log: list[str], empty: bool = False) -> None:
        self.log, self.empty, self.step_id = log, empty, 0
        self.updates: list[int] = []

    def plan(self) -> IterationPlan:
        self.step_id += 1
        self.log.append(f"plan {self.step_id}")
        plan = IterationPlan(step_id=self.step_id)
        if not self.empty:
            plan.freed.append("gone")  # something for the engine to do
        return plan

    def update(self, plan: IterationPlan, result: IterationResult) -> list[Request]:
        self.log.append(f"update {plan.step_id}")
        self.updates.append(plan.step_id)
        return []

    def has_work(self) -> bool:
        return True


class LoggingJobs:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def schedule(self, plan: IterationPlan) -> None:
        self.log.append(f"jobs schedule {plan.step_id}")

    def update(self, plan: IterationPlan, result: IterationResult) -> None:
        self.log.append(f"jobs update {result.step_id}")


def fcfs() -> InferencePlanner:
    config = SchedulerConfig(max_model_len=64, block_size=4, max_batch_tokens=32)
    return InferencePlanner(config, KVBlockManager(64, 4, True), AdapterSlots(2))


def engine_of(engine: Engine) -> Engine:
    """Typed against the protocol: mypy checks that FakeEngine implements it."""
    return engine


def test_step_plans_then_executes_then_updates_jobs_then_the_policy() -> None:
    log: list[str] = []
    core = EngineCore(LoggingSource(log), LoggingJobs(log))
    core.step(engine_of(FakeEngine(log)))
    core.step(FakeEngine(log))
    assert log == ["plan 1", "jobs schedule 1", "step 1", "jobs update 1", "update 1",
                   "plan 2", "jobs schedule 2", "step 2", "jobs update 2", "update 2"]


def test_a_policy_runs_requests_to_completion_and_each_step_names_the_requests_that_advanced() -> None:
    policy = fcfs()
    policy.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3)))
    policy.add_request(Request("b", [9, 8], SamplingParams(max_tokens=2)))
    core, engine = EngineCore(policy), FakeEngine()
    advanced: list[list[str]] = []
    while core.has_work():
        step = core.step(engine)
        advanced.append([r.request_id for r in step.advanced])
        assert set(step.logprobs()) == {r.request_id for r in step.advanced}
    assert advanced == [["a", "b"], ["a", "b"], ["a"], []]  # the last plan frees "a" in the engine
    assert policy.kv.num_free_blocks == policy.kv.num_blocks


def test_a_failed_in_process_step_raises_and_leaves_the_policy_unapplied() -> None:
    log: list[str] = []
    source, engine = LoggingSource(log), FakeEngine(log)
    core = EngineCore(source)
    engine.fail = RuntimeError("device lost")
    with pytest.raises(RuntimeError, match="device lost"):
        core.step(engine)
    assert source.updates == [] and core.in_flight is None
    engine.fail = None
    assert core.step(engine).plan.step_id == 2 and source.updates == [2]


def test_the_halves_keep_one_plan_in_flight_until_its_result_is_applied() -> None:
    log: list[str] = []
    source = LoggingSource(log)
    core = EngineCore(source)
    plan = core.next_plan()
    assert plan is not None and core.in_flight is plan
    with pytest.raises(PlanInFlight):
        core.next_plan()
    step = core.apply(answer(plan))
    assert step.plan is plan and source.updates == [1] and core.in_flight is None


def test_a_result_for_the_wrong_plan_is_refused_and_the_policy_is_not_updated() -> None:
    source = LoggingSource([])
    core = EngineCore(source)
    with pytest.raises(PlanMismatch, match="no plan is in flight"):
        core.apply(IterationResult(step_id=1))  # nothing was handed out
    plan = core.next_plan()
    assert plan is not None
    with pytest.raises(PlanMismatch, match="step 99 does not answer plan 1"):
        core.apply(IterationResult(step_id=99))
    assert source.updates == [] and core.in_flight is None  # the plan is dropped: its engine answered wrong
    with pytest.raises(PlanMismatch):
        core.apply(answer(plan))  # a late answer to the dropped plan is refused too


def test_an_in_process_engine_answering_another_step_is_refused_before_any_update() -> None:
    log: list[str] = []
    source, jobs = LoggingSource(log), LoggingJobs(log)

    class Confused:
        def step(self, plan: IterationPlan) -> IterationResult:
            return answer(IterationPlan(step_id=plan.step_id + 1))

    with pytest.raises(PlanMismatch, match="step 2 does not answer plan 1"):
        EngineCore(source, jobs).step(Confused())
    assert source.updates == [] and "jobs update 2" not in log and "jobs update 1" not in log


def test_an_engine_failure_fails_the_plan_in_flight_without_an_update() -> None:
    source = LoggingSource([])
    core = EngineCore(source)
    plan = core.next_plan()
    assert plan is not None
    with pytest.raises(StepFailed) as failed:
        core.apply(EngineFailure(step_id=plan.step_id, message="CUDA error: out of memory"))
    assert failed.value.plan is plan and failed.value.message == "CUDA error: out of memory"
    assert source.updates == [] and core.in_flight is None
    assert core.next_plan() is not None  # the loop goes on


def test_an_empty_plan_is_not_handed_out() -> None:
    source = LoggingSource([], empty=True)
    core = EngineCore(source)
    assert core.next_plan() is None and core.in_flight is None
    assert core.next_plan() is None  # nothing in flight: planning again is allowed


def test_stopping_a_request_from_the_outputs_takes_effect_in_the_next_plan() -> None:
    policy = fcfs()
    policy.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    core, engine = EngineCore(policy), FakeEngine()
    step = core.step(engine)
    assert [r.request_id for r in step.advanced] == ["a"]
    policy.abort("a", RequestStatus.FINISHED_STOPPED)  # a stop string, seen by the output side
    plan = core.step(engine).plan
    assert plan.freed == ["a"] and not plan.chunks and not core.has_work()


def test_the_loop_and_the_contract_import_no_torch() -> None:
    code = ("import sys, coserve.cluster.engine_core, coserve.finetune.pieces; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
