"""The co-serving policy with the hybrid share against a fake engine: inference first, fine-tuning up to
the SLO, VTC, guards."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coserve.contract.job_spec import JobEventKind, JobPhase
from coserve.contract.plan import IterationPlan
from coserve.contract.sampling import AdapterRef
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.request import RequestStatus
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.hybrid import HybridShare
from coserve.planner.latency import LatencyModel, PlanFeatures, plan_features
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserving_sim import BS, COEFFICIENTS, FP, FakeClock, execute, keep_busy, make_job, make_policy, make_request, step


def predicted(policy: CoServingPolicy, plan: IterationPlan, extra: PlanFeatures | None = None) -> float:
    features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
    return policy.latency.predict(features + (extra or PlanFeatures()))


ONE_TOKEN = PlanFeatures(ft_forward_tokens=1)


# ----------------------------------------------------------------------------- the SLO budget

def test_forward_window_fills_the_iteration_up_to_the_slo() -> None:
    policy = make_policy(tpot_slo_ms=20.0, scheduler={"max_batch_tokens": 256})
    for i in range(4):
        policy.add_request(make_request(f"r{i}", "bob", max_tokens=8))
    step(policy)  # the four prefills
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    # 4 decodes (4 ms) leave 16 ms: 160 forward tokens at 0.1 ms; one more would break the SLO.
    assert [c.num_tokens for c in plan.chunks] == [1, 1, 1, 1]
    assert plan.training.forward_tokens == 160
    assert predicted(policy, plan) <= 0.020 < predicted(policy, plan, ONE_TOKEN)


@pytest.mark.parametrize("slower", [1.3, 0.8])
def test_iterations_that_run_over_their_prediction_shrink_the_fine_tuning_budget(slower: float) -> None:
    """An engine `slower` x the model (a bias the online fit alone leaves, or a new machine): once the
    moving average of measured / predicted has seen it, filled iterations take the SLO on average."""
    truth = LatencyModel(FP, {k: v * slower for k, v in COEFFICIENTS.items()})
    sched = SchedulerConfig(max_model_len=128, block_size=4, max_num_seqs=8, max_batch_tokens=256)
    config = CoServingConfig(scheduler=sched, tpot_slo_ms=20.0, safety_margin=0.0)
    # A model whose online refinement barely moves: only the measured/predicted average corrects.
    stiff = LatencyModel(FP, COEFFICIENTS, prior_variance=1e-12)
    policy = CoServingPolicy(config, KVBlockManager(1024, 4), AdapterSlots(4), stiff, share=HybridShare(),
                             clock=FakeClock())
    keep_busy(policy, max_tokens=100)  # a running request: the SLO binds
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(2000,) * 4, max_window_tokens=400,
                            n_epochs=50))
    measured = []
    for _ in range(60):
        plan = policy.plan()
        features = plan_features(plan, {c.request_id: -1 for c in plan.chunks})
        training = plan.training
        actual = truth.predict(features.with_finetune(
            training.forward_tokens, training.backward_token_layers,
            len(training.forward_windows) + len(training.backward_tasklets)))
        policy.update(plan, execute(plan, actual))
        measured.append(actual)
    late = measured[-20:]
    assert min(late) > 0  # every iteration trains
    assert sum(late) / len(late) <= 0.020 * 1.03
    if slower < 1:  # a faster engine is not held back: iterations still fill towards the SLO
        assert sum(late) / len(late) >= 0.020 * 0.9


def test_safety_margin_shrinks_the_fine_tuning_share() -> None:
    policy = make_policy(tpot_slo_ms=20.0, safety_margin=0.25, scheduler={"max_batch_tokens": 256})
    keep_busy(policy)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    assert plan.training.forward_tokens in (139, 140)  # 15 ms - 1 ms decode, 0.1 ms tokens, rounding
    assert predicted(policy, plan) <= 0.015 < predicted(policy, plan, ONE_TOKEN)


def test_forward_windows_share_max_batch_tokens_with_inference() -> None:
    policy = make_policy(tpot_slo_ms=1000.0, scheduler={"max_batch_tokens": 64})
    policy.add_request(make_request("r", "bob", prompt_len=20))
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    assert plan.num_tokens == 20 and plan.training.forward_tokens == 44


def test_backward_phase_gets_token_layers_within_the_slo() -> None:
    # 0.01 ms per token-layer and 4 layers: a 24-token sequence's backward is 96 token-layers (~1 ms).
    policy = make_policy(tpot_slo_ms=5.0, coefficients={**COEFFICIENTS, "ft_backward_token_layers": 1e-4},
                         scheduler={"max_num_seqs": 2})
    keep_busy(policy)  # 1 ms of decode in every iteration
    job = make_job(policy, "j", "acme", lengths=(24,), num_layers=4)
    policy.jobs.add(job)
    plan, _ = step(policy)
    assert plan.training.forward_tokens == 24 and job.phase is JobPhase.BACKWARD
    budgets = []
    while job.phase is JobPhase.BACKWARD and len(budgets) < 10:
        plan, _ = step(policy)
        budgets.append(plan.training.backward_token_layers)
    assert budgets[0] == 40  # (5 ms - 1 ms decode) / 0.1 ms
    assert sum(budgets) == 96 and all(b <= 40 for b in budgets)


def test_a_backward_budget_over_several_layers_pays_a_piece_per_layer() -> None:
    """12 layers of a 24-token sequence, a piece 0.5 ms, a token-layer 0.01 ms: 4 ms beside the decode
    fit 5 whole layers (0.74 ms each), not the 350 token-layers one piece's price would give (14 layers,
    7 ms of pieces). Every plan's prediction with its real tasklets stays within the SLO."""
    coefficients = {**COEFFICIENTS, "ft_backward_token_layers": 1e-5, "ft_pieces": 5e-4}
    policy = make_policy(tpot_slo_ms=5.0, coefficients=coefficients, scheduler={"max_num_seqs": 2})
    keep_busy(policy)  # 1 ms of decode in every iteration
    job = make_job(policy, "j", "acme", lengths=(24,), num_layers=12)
    policy.jobs.add(job)
    plan, _ = step(policy)
    assert job.phase is JobPhase.BACKWARD
    budgets = []
    while job.phase is JobPhase.BACKWARD and len(budgets) < 10:
        plan, _ = step(policy)
        budgets.append(plan.training.backward_token_layers)
        assert predicted(policy, plan) <= 0.005  # its features count every tasklet (`plan_features`)
    assert budgets[0] == 5 * 24
    assert sum(budgets) == 12 * 24


def test_no_fine_tuning_when_inference_alone_reaches_the_slo() -> None:
    policy = make_policy(tpot_slo_ms=8.0, scheduler={"max_num_seqs": 8, "max_batch_tokens": 64})
    for i in range(8):
        policy.add_request(make_request(f"r{i}", "bob", max_tokens=8))
    step(policy)
    policy.jobs.add(make_job(policy, "j", "acme"))
    plan, _ = step(policy)  # 8 decodes: 8 ms, the whole budget
    assert len(plan.chunks) == 8 and plan.training.forward_tokens == 0


# ------------------------------------------------------------------------------------ VTC

def test_admission_follows_the_least_counter_tenant() -> None:
    policy = make_policy(scheduler={"max_num_seqs": 1})
    for i in range(3):
        policy.add_request(make_request(f"a{i}", "a", max_tokens=1))
    policy.add_request(make_request("b0", "b", max_tokens=1))
    order = []
    for _ in range(4):
        plan, _ = step(policy)
        order += [s.request_id for s in plan.new_sequences]
    # Both start at 0 (ties by name: a); then a's counter is ahead, so b goes before a's backlog.
    assert order == ["a0", "b0", "a1", "a2"]


def test_input_is_charged_once_and_outputs_per_token() -> None:
    policy = make_policy(num_blocks=4, scheduler={"max_num_seqs": 2, "max_model_len": 16})
    policy.add_request(make_request("x", "a", prompt_len=7, max_tokens=6))
    policy.add_request(make_request("y", "b", prompt_len=7, max_tokens=6))
    preempted = False
    for _ in range(30):
        plan, _ = step(policy)
        preempted |= bool(plan.freed and policy.has_unfinished())
        if not policy.has_work():
            break
    assert preempted  # 4 blocks of 4 tokens cannot hold both 13-token sequences
    w = policy.vtc.weights
    assert policy.vtc.counter("a") == pytest.approx(w.w_p * 7 + w.w_q * 6)
    assert policy.vtc.counter("b") == pytest.approx(w.w_p * 7 + w.w_q * 6)


def test_jobs_are_picked_by_counter_and_tasklets_charged_by_layers() -> None:
    # Room for one 16-token window per iteration: the job of the least-served tenant gets it.
    policy = make_policy(tpot_slo_ms=2.6, scheduler={"max_batch_tokens": 64, "max_num_seqs": 1})
    keep_busy(policy)  # 1 ms of decode in every iteration
    for tenant in ("a", "b"):
        policy.jobs.add(make_job(policy, f"job-{tenant}", tenant, lengths=(48,), adapter_id=ord(tenant)))
    start = {t: policy.vtc.counter(t) for t in "ab"}  # lifted to the busy tenant's when backlogged
    takers = []
    for _ in range(6):
        plan, _ = step(policy)
        takers.append(plan.training.forward_windows[0].sequence_id.split("/")[0])
    assert takers == ["job-a", "job-b"] * 3
    assert policy.vtc.counter("a") - start["a"] == policy.vtc.counter("b") - start["b"] == 48


# ------------------------------------------------------------------------------ TTFT guard

def test_waiting_requests_limit_fine_tuning_to_what_keeps_them_within_the_ttft_guard() -> None:
    """A request that cannot be admitted (max_num_seqs) waits for running ones, which fine-tuning slows
    down: fine-tuning takes work only while the longest-waiting request stays within the TTFT guard
    with this iteration (the hold says why), and fills iterations again once nobody waits."""
    clock = FakeClock()
    policy = make_policy(clock=clock, ttft_slo_ms=1000.0, ttft_guard_fraction=0.5, scheduler={"max_num_seqs": 1})
    policy.add_request(make_request("first", "a", max_tokens=6))
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,)))
    plan, _ = step(policy)
    assert plan.training.forward_tokens > 0  # nobody waits: fine-tuning fills the iteration
    policy.add_request(make_request("second", "b", max_tokens=3, arrival=0.0))
    clock.now = 0.3  # 0.2 s left of the 0.5 s guard: more than the 20 ms iteration budget
    plan, _ = step(policy)
    assert policy.num_waiting and plan.training.forward_tokens + plan.training.backward_token_layers > 0
    clock.now = 0.49  # 10 ms left: less than an iteration may take
    sizes = []
    for _ in range(6):
        plan, _ = step(policy)
        sizes.append((policy.num_waiting, plan.training.forward_tokens + plan.training.backward_token_layers))
        if policy.num_waiting:
            assert (policy.jobs.finetune_held_back or "").startswith(
                "held back: 1 inference request(s) wait for admission"), policy.jobs.finetune_held_back
    assert sizes[0][0] and all(work == 0 for waiting, work in sizes if waiting)
    assert any(work > 0 for waiting, work in sizes if not waiting)


def test_overdue_request_goes_first_and_stops_fine_tuning() -> None:
    clock = FakeClock()
    policy = make_policy(clock=clock, ttft_slo_ms=1000.0, ttft_guard_fraction=0.5,
                         scheduler={"max_num_seqs": 1})
    policy.add_request(make_request("first", "a", max_tokens=5))
    policy.jobs.add(make_job(policy, "j", "t", lengths=(400,)))
    step(policy)
    policy.add_request(make_request("old", "b", arrival=0.0))  # b's counter will be the highest
    policy.vtc.charge_input("b", 1000)
    policy.add_request(make_request("new", "c", arrival=0.4))
    clock.now = 0.49
    plan, _ = step(policy)
    assert plan.training.forward_tokens == 0  # "old" is 10 ms from the guard: inference first
    clock.now = 0.6  # "old" has waited 0.6 s >= 0.5 s
    admitted: list[str] = []
    guarded = 0
    for _ in range(8):
        plan, _ = step(policy)
        admitted += [s.request_id for s in plan.new_sequences]
        if not admitted:  # "old" waits for "first" to finish: the batch must not grow training work
            assert plan.training.forward_tokens == 0
            guarded += 1
    assert guarded == 3 and admitted[:2] == ["old", "new"]  # despite c's lower counter


# ------------------------------------------------------------------------- KV yield

def test_fine_tuning_yields_kv_blocks_to_inference() -> None:
    policy = make_policy(num_blocks=16, tpot_slo_ms=1000.0,
                         scheduler={"max_batch_tokens": 40, "max_model_len": 40})
    job = make_job(policy, "j", "t", lengths=(60,), max_window_tokens=40)
    policy.jobs.add(job)
    step(policy)  # a 40-token window: 10 of the 16 blocks
    assert policy.kv.num_free_blocks == 6
    policy.add_request(make_request("r", "u", prompt_len=36, max_tokens=2))  # needs 10 blocks
    plan, _ = step(policy)
    assert [s.request_id for s in plan.new_sequences] == ["r"]
    assert plan.training.sequence_drops == [job.spec.job_id + "/s1.0"]
    assert not plan.freed  # nothing of inference was preempted
    for _ in range(30):
        if not policy.has_work():
            break
        step(policy)
    assert [e.kind for e in policy.jobs.pop_events()][-1] is JobEventKind.SUCCEEDED


# -------------------------------------------------------------------- jobs and the model

def test_remove_job_stops_it_in_the_next_plan() -> None:
    policy = make_policy()
    policy.jobs.add(make_job(policy, "j", "t", lengths=(200,)))
    step(policy)
    assert policy.jobs.cancel("j") and not policy.jobs.cancel("nope")
    plan, _ = step(policy)
    assert plan.training.job_stops == ["j"] and plan.training.forward_tokens == 0
    assert [e.kind for e in policy.jobs.pop_events()] == [JobEventKind.CANCELLED]
    assert policy.jobs.get("j") is None and not policy.has_work()
    assert policy.kv.num_free_blocks == policy.kv.num_blocks


def test_measured_iterations_refine_the_latency_model() -> None:
    policy = make_policy()
    for i in range(3):
        policy.add_request(make_request(f"r{i}", "a", max_tokens=20))
    before = policy.latency.coefficients
    for _ in range(10):
        step(policy, total_s=0.050)  # far slower than the 1 ms/decode model predicts
    assert policy.latency.coefficients != before
    plan = policy.plan()
    assert predicted(policy, plan) > 0.010
    policy.update(plan, execute(plan))


# ------------------------------------------------------------------------------ settings

@pytest.mark.parametrize(("settings", "name"), [
    ({"tpot_slo_ms": 0.0}, "tpot_slo_ms"),
    ({"tpot_slo_ms": -5.0}, "tpot_slo_ms"),
    ({"ttft_slo_ms": 0.0}, "ttft_slo_ms"),
    ({"safety_margin": 1.0}, "safety_margin"),
    ({"ttft_guard_fraction": 0.0}, "ttft_guard_fraction"),
    ({"tenant_weights": {"acme": 0.0}}, "tenant_weights\\['acme'\\]"),
    ({"max_backward_token_layers": 0}, "max_backward_token_layers"),
    ({"max_stall_ms": 50.0}, "max_stall_ms=50.0 is below tpot_slo_ms=100"),
    ({"max_stall_ms": float("inf")}, "max_stall_ms"),
])
def test_invalid_settings_name_the_setting(settings: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        CoServingConfig(scheduler=SchedulerConfig(max_model_len=64), **settings)


def test_token_budget_smaller_than_a_decode_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens=8 .* max_num_seqs=16"):
        CoServingConfig(scheduler=SchedulerConfig(max_model_len=64, max_num_seqs=16, max_batch_tokens=8))


def test_slo_below_one_decode_batch_is_warned_about_and_jobs_still_run() -> None:
    config = CoServingConfig(scheduler=SchedulerConfig(max_model_len=64, max_num_seqs=32,
                                                       block_size=4), tpot_slo_ms=20.0)
    policy = CoServingPolicy(config, KVBlockManager(64, 4), AdapterSlots(2), LatencyModel(FP, COEFFICIENTS),
                             share=HybridShare(), clock=FakeClock())
    assert policy.slo_warning is not None  # 32 decodes at 1 ms each
    assert "tpot_slo_ms=20" in policy.slo_warning and "--tpot-slo-ms" in policy.slo_warning
    ok = CoServingPolicy(replace(config, tpot_slo_ms=40.0), KVBlockManager(64, 4), AdapterSlots(2),
                         LatencyModel(FP, COEFFICIENTS), share=HybridShare())
    assert ok.slo_warning is None


def test_aborted_waiting_request_leaves_its_tenant_idle() -> None:
    policy = make_policy()
    policy.add_request(make_request("r", "a"))
    assert "a" in policy.vtc.backlogged
    assert policy.abort("r")
    assert "a" not in policy.vtc.backlogged and not policy.has_work()
    assert policy.get_request("r") is None
    assert RequestStatus.FINISHED_ABORTED.is_finished


def test_jobs_of_one_tenant_take_turns() -> None:
    policy = make_policy(tpot_slo_ms=2.6, scheduler={"max_batch_tokens": 64, "max_num_seqs": 1})
    keep_busy(policy)
    for k in range(2):
        policy.jobs.add(make_job(policy, f"j{k}", "same", lengths=(48,), adapter_id=10 + k))
    takers = [step(policy)[0].training.forward_windows[0].sequence_id.split("/")[0] for _ in range(4)]
    assert takers == ["j0", "j1", "j0", "j1"]


def test_pause_drops_the_sequence_in_flight_and_resume_restarts_it() -> None:
    policy = make_policy(tpot_slo_ms=2.0, scheduler={"max_num_seqs": 1})
    policy.jobs.add(make_job(policy, "j", "t", lengths=(100,)))
    step(policy)
    assert policy.jobs.pause("j") and not policy.jobs.pause("nope")
    plan, _ = step(policy)
    assert plan.training.sequence_drops == ["j/s1.0"] and plan.training.forward_tokens == 0
    assert policy.kv.num_free_blocks == policy.kv.num_blocks and not policy.has_work()
    assert "t" not in policy.vtc.backlogged
    assert policy.jobs.resume("j")
    plan, _ = step(policy)
    assert plan.training.sequence_starts and plan.training.forward_windows[0].start == 0


def test_a_windows_fixed_cost_is_planned_for() -> None:
    policy = make_policy(tpot_slo_ms=20.0, coefficients={**COEFFICIENTS, "ft_pieces": 5e-3},
                         scheduler={"max_batch_tokens": 256, "max_num_seqs": 4})
    keep_busy(policy)
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,), max_window_tokens=400))
    plan, _ = step(policy)
    # 20 ms - 5 ms for the window itself - 1 ms decode leaves 14 ms: 140 tokens at 0.1 ms (rounding).
    assert plan.training.forward_tokens in (139, 140)
    assert predicted(policy, plan) <= 0.020


class _RecordingModel(LatencyModel):
    """Records the features of every measured iteration the policy reports."""

    def __init__(self) -> None:
        super().__init__(FP, COEFFICIENTS)
        self.seen: list[PlanFeatures] = []

    def observe(self, features: PlanFeatures, measured_s: float) -> None:
        self.seen.append(features)
        super().observe(features, measured_s)


def test_distinct_adapters_from_the_running_tally_match_a_count_of_the_plan() -> None:
    # Admissions, finishes and preemptions (8 blocks of 4 tokens are too few for everyone) move
    # requests in and out of the tally; every plan's count must equal one made from its chunks.
    model = _RecordingModel()
    config = CoServingConfig(scheduler=SchedulerConfig(max_model_len=32, block_size=BS, max_num_seqs=8,
                                                       max_batch_tokens=16), tpot_slo_ms=20.0)
    policy = CoServingPolicy(config, KVBlockManager(num_blocks=8, block_size=BS), AdapterSlots(3),
                             model, share=HybridShare(), clock=FakeClock())
    for i in range(12):
        request = make_request(f"r{i}", prompt_len=3 + i % 5, max_tokens=2 + i % 7)
        request.adapter = AdapterRef(i % 4, f"a{i % 4}", f"/a{i % 4}") if i % 3 else None
        policy.add_request(request)
    expected: list[float] = []
    preempted = 0
    while policy.has_work():
        plan = policy.plan()
        preempted += sum(policy.get_request(rid) is not None for rid in plan.freed)
        slot_of = {seq.request_id: seq.adapter_slot for seq in plan.new_sequences}
        for chunk in plan.chunks:
            request = policy.get_request(chunk.request_id)
            if chunk.request_id not in slot_of:
                adapter = request.adapter
                slot_of[chunk.request_id] = -1 if adapter is None else policy.adapters.slot_of(
                    adapter.adapter_id)
        expected.append(plan_features(plan, slot_of).distinct_adapters)
        policy.update(plan, execute(plan, total_s=1e-3))
    assert [f.distinct_adapters for f in model.seen] == expected
    assert max(expected) >= 2 and len(expected) > 12 and preempted > 0


def test_bursts_wait_until_every_running_request_banked_time() -> None:
    # TPOT target 20 ms, bursts up to 60 ms; a decode alone takes 1 ms, and the job has more work
    # than any iteration holds (a forward token 1 ms, a backward token-layer 0.2 ms).
    clock = FakeClock()
    costs = {**COEFFICIENTS, "ft_forward_tokens": 1e-3, "ft_backward_token_layers": 2e-4}
    policy = make_policy(clock=clock, max_stall_ms=60.0, coefficients=costs)
    policy.jobs.add(make_job(policy, "j", "ft", lengths=(200,), n_epochs=50))
    policy.add_request(make_request("a", max_tokens=40))
    token_times, bursts = [], []
    while policy.get_request("a") is not None:
        plan = policy.plan()
        seconds = policy.latency.predict(plan_features(plan, {"a": -1}))
        clock.now += seconds
        policy.update(plan, execute(plan, total_s=seconds))
        if token_times and (plan.training.forward_windows or plan.training.backward_tasklets):
            bursts.append(seconds)
        token_times.append(clock.now)
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    for n in range(1, len(gaps) + 1):  # after every token, the mean so far is within the target
        assert sum(gaps[:n]) / n <= 0.020 + 1e-9
    assert max(gaps) <= 0.060 + 1e-9
    # Bursts came (longer than the per-iteration target), each after decodes that banked the time:
    # every gap over the target is a burst's.
    assert len(bursts) >= 3 and max(bursts) > 0.040
    assert 0 < sum(1 for g in gaps if g > 0.020) <= len(bursts)


def _prefill_after_banking(ttft_slo_ms: float) -> tuple[IterationPlan, float]:
    """'a' decodes alone and banks ~150 ms (20 ms target, 1 ms decodes, bursts up to 60 ms); then a
    job comes and 'b' arrives. Returns the iteration of b's prefill and how long after b's arrival it
    ended (b's TTFT)."""
    clock = FakeClock()
    costs = {**COEFFICIENTS, "ft_forward_tokens": 1e-3, "ft_backward_token_layers": 2e-4}
    policy = make_policy(clock=clock, max_stall_ms=60.0, ttft_slo_ms=ttft_slo_ms, coefficients=costs)

    def run_one() -> IterationPlan:
        plan = policy.plan()
        clock.now += policy.latency.predict(plan_features(plan, {c.request_id: -1 for c in plan.chunks}))
        policy.update(plan, execute(plan))
        return plan

    policy.add_request(make_request("a", max_tokens=60))
    for _ in range(9):  # a's prefill and 8 decodes
        assert not _has_finetune(run_one())
    policy.jobs.add(make_job(policy, "j", "ft", lengths=(200,), n_epochs=50))
    arrival = clock.now
    policy.add_request(make_request("b", prompt_len=10, max_tokens=20, arrival=arrival))
    plan = run_one()
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert policy.get_request("b").num_output_tokens == 1
    return plan, clock.now - arrival


def _has_finetune(plan: IterationPlan) -> bool:
    return bool(plan.training.forward_windows or plan.training.backward_tasklets)


def test_a_burst_rides_along_a_prefill_only_within_the_ttft_guard() -> None:
    # The guard is half the TTFT SLO. With 1 s, the burst is the stall cap's (a banked enough).
    plan, ttft = _prefill_after_banking(ttft_slo_ms=2000.0)
    assert _has_finetune(plan) and 0.055 < ttft <= 0.060 + 1e-9
    # With 50 ms the burst ends by the guard.
    plan, ttft = _prefill_after_banking(ttft_slo_ms=100.0)
    assert _has_finetune(plan) and 0.040 < ttft <= 0.050 + 1e-9
    # With 30 ms, less than a burst's minimum (two 20 ms budgets): b's prefill runs alone.
    plan, ttft = _prefill_after_banking(ttft_slo_ms=60.0)
    assert not _has_finetune(plan) and ttft < 0.010
