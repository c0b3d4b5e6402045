"""A reinforcement job's rollout loop inside the cluster: its rollouts are pinned to the job's engine (never
stolen by another, dropped when that engine is lost), grading runs off the loop (the job waits, saying so,
and the watchdog's marker moves with the rollouts), a batch no sample of which could be graded fails the
job, and every job ends its rollouts when it ends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from cluster_sim import cluster
from coserve.cluster.engine_cluster import EngineCluster
from coserve.contract.grader import Grader, parse_grader
from coserve.contract.job_spec import FinetuneJobSpec, JobEventKind
from coserve.contract.loss_spec import LossKind, LossSpec
from coserve.contract.plan import IterationPlan, IterationResult, TokenLogprobs
from coserve.contract.reinforcement import GradedSample, RolloutSpec
from coserve.contract.sampling import EosIds
from coserve.contract.training_plan import TrainingExample
from coserving_sim import execute

GRADER = parse_grader({"type": "string_check", "name": "s", "input": "{{ sample.output_text }}",
                       "reference": "x", "operation": "eq"})


class LogprobEngine:
    """Executes plans by hand, with a log-prob for every sampled token (rollouts keep them)."""

    def step(self, plan: IterationPlan) -> IterationResult:
        result = execute(plan)
        for sampled in result.sampled:
            sampled.logprobs = TokenLogprobs(sampled.token_id, -1.0, 1, [], [])
        return result


class HeldGrading:
    """Grades when the test says so: reward = index of the sample in its batch, or errors for all."""

    def __init__(self) -> None:
        self.pending: list[tuple[Future[list[GradedSample]], int, str]] = []
        self.fail_all = False
        self.raise_for: set[str] = set()  # tenants whose grading raises as a whole (a bug in the pool)

    def grade(self, tenant: str, grader: Grader, items: Sequence[Mapping[str, Any]],
              completions: Sequence[Sequence[int]]) -> Future[list[GradedSample]]:
        future: Future[list[GradedSample]] = Future()
        self.pending.append((future, len(completions), tenant))
        return future

    def release(self) -> None:
        for future, count, tenant in self.pending:
            if tenant in self.raise_for:
                future.set_exception(RuntimeError("the grading pool broke"))
                continue
            grades = [GradedSample(0.0, {}, "boom") if self.fail_all else GradedSample(float(i % 2))
                      for i in range(count)]
            future.set_result(grades)
        self.pending.clear()


def rl_spec(job_id: str = "rl", n_epochs: int = 1, evaluate: bool = False, tenant: str = "a",
            adapter_id: int = 300) -> FinetuneJobSpec:
    prompts = [[1, 2, 3, 4 + i] for i in range(4)]
    rollouts = RolloutSpec(GRADER, [{"i": i} for i in range(4)], samples=2, max_tokens=3,
                           eval_prompts=[[5, 6, 7]] if evaluate else [], eval_items=[{}] if evaluate else [])
    return FinetuneJobSpec(job_id=job_id, tenant=tenant, adapter_id=adapter_id, n_epochs=n_epochs, batch_size=2, seed=1,
                           examples=[TrainingExample(p, [False] * len(p)) for p in prompts], num_layers=4,
                           output_dir=f"/out/{job_id}", min_tasklet_tokens=1,
                           loss=LossSpec(LossKind.IMPORTANCE_SAMPLING), rollouts=rollouts)


def rl_cluster(engines: int = 1) -> tuple[EngineCluster, HeldGrading]:
    c = cluster(engines)
    grading = HeldGrading()
    c.jobs.serve_rollouts(grading, EosIds(eos=None, extra=()))
    return c, grading


def step_all(c: EngineCluster, rounds: int = 1) -> None:
    for _ in range(rounds):
        for engine_id in c.engines:
            if c.has_work(engine_id):
                c.step(engine_id, LogprobEngine())


def test_rollouts_are_sampled_graded_off_the_loop_and_trained_with_events() -> None:
    c, grading = rl_cluster()
    c.jobs.start(rl_spec(evaluate=True))
    step_all(c, 10)  # the first batch (2 prompts x 2 samples) and the base's evaluation sample, 3 tokens each
    assert grading.pending and len(grading.pending) == 2
    job = c.jobs.get("rl")
    assert job is not None and job.position.step == 0
    assert "grading the 4 rollouts of step 1" in (c.jobs.held_back("rl") or "")
    marker = job.progress_marker
    grading.release()
    for _ in range(200):
        step_all(c)
        grading.release()
        if c.jobs.get("rl") is None:
            break
    events = c.jobs.pop_events()
    kinds = [(e.kind, e.step) for e in events]
    assert (JobEventKind.SUCCEEDED, 2) in kinds
    steps = [e for e in events if e.kind is JobEventKind.STEP]
    assert [e.step for e in steps] == [1, 2] and all(e.metrics["train_reward_mean"] == 0.5 for e in steps)
    validations = [e.step for e in events if e.kind is JobEventKind.VALIDATION]
    assert validations == [0, 1, 2]  # base, eval_interval 1, final (before the job's end)
    assert kinds.index((JobEventKind.VALIDATION, 2)) < kinds.index((JobEventKind.SUCCEEDED, 2))
    assert job.progress_marker != marker
    assert not c.has_unfinished()


def test_a_batch_no_sample_of_which_could_be_graded_fails_the_job() -> None:
    c, grading = rl_cluster()
    c.jobs.start(rl_spec())
    grading.fail_all = True
    for _ in range(50):
        step_all(c)
        grading.release()
    (failed,) = [e for e in c.jobs.pop_events() if e.kind is JobEventKind.FAILED]
    assert failed.code == "grader_failed" and "boom" in failed.message and "none of the 4 samples" in failed.message
    assert c.jobs.get("rl") is None and not c.has_unfinished()


def test_a_rollout_loop_that_raises_fails_its_own_job_only() -> None:
    """Grading that raises as a whole (not one sample's grader: that sample scores 0) fails that job with
    `rollouts_failed`; the step it came with, and another tenant's job beside it, go on to the end."""
    c, grading = rl_cluster()
    c.jobs.start(rl_spec("bad", tenant="attacker"))
    c.jobs.start(rl_spec("good", tenant="victim", adapter_id=301))
    grading.raise_for.add("attacker")
    events = []
    for _ in range(300):
        step_all(c)
        grading.release()
        events += c.jobs.pop_events()
        if c.jobs.get("bad") is None and c.jobs.get("good") is None:
            break
    ends = {e.job_id: e for e in events if e.kind in (JobEventKind.FAILED, JobEventKind.SUCCEEDED)}
    assert ends["bad"].kind is JobEventKind.FAILED and ends["bad"].code == "rollouts_failed"
    assert "RuntimeError" in ends["bad"].message and "pool broke" not in ends["bad"].message
    assert ends["good"].kind is JobEventKind.SUCCEEDED
    assert not c.has_unfinished()


def test_rollouts_stay_on_their_engine_and_are_dropped_with_it() -> None:
    c, grading = rl_cluster(engines=2)
    c.jobs.start(rl_spec())
    home = c.jobs.engine_of("rl")
    assert home == "e0"
    c.step("e0", LogprobEngine())  # the job starts; its driver submits the first rollouts on e0
    rollouts = [rid for rid in list(c.member("e0").requests) if rid.startswith("rl/")]
    assert rollouts and all(c.engine_of(r) == "e0" for r in rollouts)
    assert not c.member("e0").unsent  # nothing another engine could steal
    step_all(c, 2)
    assert all(c.engine_of(r) in ("e0", None) for r in rollouts)
    moved = c.engine_lost("e0")
    assert not moved.rerouted and not moved.stranded  # dropped with the job's restart, never re-routed
    assert all(c.engine_of(r) is None for r in rollouts)
    assert c.jobs.engine_of("rl") == "e1"


def test_cancelling_a_job_aborts_its_rollouts() -> None:
    c, _ = rl_cluster()
    c.jobs.start(rl_spec())
    step_all(c, 2)
    assert c.has_unfinished()
    c.jobs.cancel("rl")
    step_all(c, 2)
    assert JobEventKind.CANCELLED in {e.kind for e in c.jobs.pop_events()}
    assert not c.has_unfinished()
