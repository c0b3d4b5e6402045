"""Driven training runs inside the cluster, with a simulated engine: calls done in order, their
outcomes (log-probs per datum, steps, saves), refusals, runs waiting for an adapter slot (saying why),
and sessions that end their runs."""

from __future__ import annotations

from pathlib import Path

from cluster_sim import builder, cluster, job_spec
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.training_runs import TrainingRuns
from coserve.contract.loss_spec import LossSpec, TokenInputs
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.sampling import AdapterRef
from coserve.contract.training_calls import (
    CallFailure,
    CallPending,
    CallTicket,
    ForwardBackwardCall,
    ForwardBackwardOutcome,
    LoadCall,
    OptimStepCall,
    OptimStepOutcome,
    RunRequest,
    SaveCall,
    SaveOutcome,
    TrainingDatum,
)
from coserve.contract.training_plan import WindowReport
from coserve.contract.training_settings import AdamStep, LoRASettings
from coserving_sim import FakeClock, execute

SESSION = "session-" + "0" * 24
OTHER_SESSION = "session-" + "1" * 24


class WindowEngine:
    """Executes plans by hand; each window reports a loss of 1 per token, a sequence that asks for them
    gets log-prob -t for token t on its last window, and a save writes a folder with one file."""

    def __init__(self) -> None:
        self.lengths: dict[str, int] = {}
        self.done: dict[str, int] = {}

    def step(self, plan: IterationPlan) -> IterationResult:
        result = execute(plan)
        for save in plan.training.saves:
            Path(save.path).mkdir(parents=True, exist_ok=True)
            (Path(save.path) / "adapter_model.safetensors").write_bytes(b"0" * 100)
        for start in plan.training.sequence_starts:
            if start.report_logprobs and start.example is not None:
                self.lengths[start.sequence_id] = len(start.example.token_ids)
        for w in plan.training.forward_windows:
            end = w.start + w.num_tokens
            length = self.lengths.get(w.sequence_id)
            logprobs = [-float(t) for t in range(length)] if length == end else None
            result.training.windows.append(WindowReport(w.sequence_id, float(w.num_tokens), w.num_tokens, logprobs))
        return result


def runs(tmp_path: Path, slots: int = 2) -> tuple[EngineCluster, TrainingRuns, FakeClock, WindowEngine]:
    c = cluster(1, builder(num_slots=slots))
    clock = FakeClock()
    return c, TrainingRuns(c.jobs, ("base", "/models/base"), tmp_path, 4, 60.0, clock), clock, WindowEngine()


def run_until(c: EngineCluster, r: TrainingRuns, engine: WindowEngine, rounds: int = 50) -> None:
    for _ in range(rounds):
        for engine_id in c.engines:
            if c.has_work(engine_id):
                c.step(engine_id, engine)
        r.after_step()


def create(r: TrainingRuns, tenant: str = "a", session: str = SESSION, n: int = 0) -> str:
    info = r.create(RunRequest(tenant, f"{session}:train:{n}", LoRASettings(r=4)))
    assert not isinstance(info, CallFailure)
    return info.run_id


def fb(*lengths: int) -> ForwardBackwardCall:
    data = [TrainingDatum(list(range(1, n + 1)), TokenInputs(weights=[0.0] + [1.0] * (n - 1))) for n in lengths]
    return ForwardBackwardCall(data, LossSpec())


def ticket(answer: CallTicket | CallFailure) -> str:
    assert isinstance(answer, CallTicket), answer
    return answer.call_id


def test_calls_run_in_order_with_their_outcomes(tmp_path: Path) -> None:
    c, r, _, engine = runs(tmp_path)
    run = create(r)
    forward = ticket(r.submit("a", run, fb(5, 9)))
    step = ticket(r.submit("a", run, OptimStepCall(AdamStep(1e-3))))
    assert isinstance(r.outcome("a", step), CallPending)
    save = ticket(r.submit("a", run, SaveCall("s1", resumable=False)))
    run_until(c, r, engine)
    done = r.outcome("a", forward)
    assert isinstance(done, ForwardBackwardOutcome)
    assert [o.logprobs for o in done.outputs] == [[-1.0, -2.0, -3.0, -4.0], [-float(t) for t in range(1, 9)]]
    assert done.loss_sum == 14.0
    stepped = r.outcome("a", step)
    assert isinstance(stepped, OptimStepOutcome) and stepped.step == 1
    saved = r.outcome("a", save)
    assert isinstance(saved, SaveOutcome) and saved.path == f"tinker://{run}/sampler_weights/s1"
    info = r.info("a", run)
    assert not isinstance(info, CallFailure) and info.steps == 1 and [k.name for k in info.checkpoints] == ["s1"]


def test_what_a_run_cannot_do_is_a_failure_not_a_hang(tmp_path: Path) -> None:
    c, r, _, engine = runs(tmp_path)
    run = create(r)
    no_gradient = ticket(r.submit("a", run, OptimStepCall(AdamStep(1e-3))))
    run_until(c, r, engine, 5)
    failed = r.outcome("a", no_gradient)
    assert isinstance(failed, CallFailure) and failed.code == "no_gradient"
    assert isinstance(r.submit("b", run, fb(4)), CallFailure)  # another tenant's run: not found
    assert isinstance(r.outcome("b", no_gradient), CallFailure)
    bad_name = r.submit("a", run, SaveCall("../x", resumable=True))
    assert isinstance(bad_name, CallFailure) and bad_name.code == "invalid_name"
    for path, code in ((f"tinker://{run}/weights/none", "path_not_found"), ("/etc/passwd", "invalid_path")):
        refused = r.submit("a", run, LoadCall(path, with_optimizer=True))
        assert isinstance(refused, CallFailure) and refused.code == code


def test_a_run_waiting_for_a_slot_says_why_and_runs_once_one_is_free(tmp_path: Path) -> None:
    """One slot: a run doing a long call holds it; another run's call waits, saying why, and runs once the
    first is idle (it parks: something waited). A silent session's runs end."""
    c, r, clock, engine = runs(tmp_path, slots=1)
    first = create(r)
    waiting = create(r, "b", OTHER_SESSION)
    long = ticket(r.submit("a", first, fb(200, 200, 200)))
    for engine_id in c.engines:
        c.step(engine_id, engine)
    call = ticket(r.submit("b", waiting, fb(4)))
    for engine_id in c.engines:
        c.step(engine_id, engine)
    pending = r.outcome("b", call)
    assert isinstance(pending, CallPending) and "adapter slots" in (pending.reason or ""), pending
    run_until(c, r, engine)
    assert isinstance(r.outcome("a", long), ForwardBackwardOutcome)
    assert isinstance(r.outcome("b", call), ForwardBackwardOutcome)
    clock.now += 45.0
    r.session_alive("b", OTHER_SESSION)
    clock.now += 30.0  # the first session is silent for 75 s: its run ends
    run_until(c, r, engine)
    closed = r.submit("a", first, fb(4))
    assert isinstance(closed, CallFailure) and closed.code == "run_closed" and "heartbeat" in closed.message
    assert r.live_runs("a") == 0 and r.live_runs("b") == 1


class Recorder(WindowEngine):
    """A `WindowEngine` that keeps the plans it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[IterationPlan] = []

    def step(self, plan: IterationPlan) -> IterationResult:
        self.plans.append(plan)
        return super().step(plan)


def test_runs_give_their_slot_back_between_calls(tmp_path: Path) -> None:
    """Four slots, eight runs of one tenant, each doing calls in turn: every call is done (a run holds a
    slot only for its call; between calls it parks, its state kept by the engine, and takes a slot again:
    JobUnpark), and runs never hold the bank's last slot (one stays for inference requests)."""
    c, r, _, engine = runs(tmp_path, slots=4)
    engine = Recorder()
    ids = [create(r, n=n) for n in range(8)]
    for _ in range(2):
        tickets = [ticket(r.submit("a", run, fb(6))) for run in ids]
        run_until(c, r, engine)
        assert all(isinstance(r.outcome("a", t), ForwardBackwardOutcome) for t in tickets)
    holding: set[str] = set()
    parked: set[str] = set()
    for plan in engine.plans:  # runs in the bank after each plan: at most 3 of its 4 slots
        work = plan.training
        assert {u.job_id for u in work.job_unparks} <= parked
        parked -= {u.job_id for u in work.job_unparks}
        holding |= {s.job_id for s in work.job_starts} | {u.job_id for u in work.job_unparks}
        holding -= set(work.job_parks)
        parked |= set(work.job_parks)
        assert len(holding) <= 3, holding
    assert len({job for plan in engine.plans for job in plan.training.job_parks}) >= 5
    assert any(plan.training.job_unparks for plan in engine.plans)
    stepped = ticket(r.submit("a", ids[0], OptimStepCall(AdamStep(1e-3))))  # its gradient came back with it
    run_until(c, r, engine)
    assert isinstance(r.outcome("a", stepped), OptimStepOutcome)


def test_a_run_whose_engine_is_lost_ends_and_its_calls_fail(tmp_path: Path) -> None:
    """A run's gradient and queued calls live in its engine: the run is not moved, its calls fail."""
    c = cluster(2, builder())
    r = TrainingRuns(c.jobs, ("base", "/models/base"), tmp_path, 4, 60.0, FakeClock())
    run = create(r)
    engine_id = c.jobs.engine_of(run)
    assert engine_id is not None
    queued = ticket(r.submit("a", run, fb(6)))
    c.engine_lost(engine_id)
    r.after_step()
    failed = r.outcome("a", queued)
    assert isinstance(failed, CallFailure) and failed.code == "run_ended"
    assert run not in c.jobs.job_ids and isinstance(r.submit("a", run, fb(4)), CallFailure)


def test_a_run_waiting_for_its_client_is_not_backlogged(tmp_path: Path) -> None:
    """Between its client's calls a run has no work: its tenant is not backlogged in the counters (it banks
    no turn while away, and is lifted when a call comes), and the engine sleeps."""
    c, r, _, engine = runs(tmp_path)
    run = create(r)
    run_until(c, r, engine, 3)
    assert "a" not in c.vtc.backlogged and not any(c.has_work(e) for e in c.engines)
    r.submit("a", run, fb(300))  # more than one iteration's work
    for engine_id in c.engines:
        c.step(engine_id, engine)
    assert "a" in c.vtc.backlogged
    run_until(c, r, engine)
    assert "a" not in c.vtc.backlogged


def test_a_job_waiting_for_an_adapter_slot_says_why(tmp_path: Path) -> None:
    """A placed job whose engine has every slot pinned (here by a request's adapter) waits, and the reason
    the watchdog reports says it waits for an adapter slot; it trains once the slot is free."""
    c, _, _, engine = runs(tmp_path, slots=1)
    adapters = c.member("e0").policy.adapters
    assert adapters.acquire(AdapterRef(7, "tenant-model", "/adapters/7")) is not None  # a request's pin
    c.jobs.start(job_spec("job", "t"))
    for _ in range(3):
        c.step("e0", engine)
    assert "adapter slot" in (c.jobs.held_back("job") or "")
    adapters.release(7)
    c.step("e0", engine)
    assert c.jobs.held_back("job") is None or "adapter slot" not in c.jobs.held_back("job")
