"""The cluster scheduler's decisions: one engine as before, routing, job placement, publication, failover."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_sim import FakeEngine, builder, cluster, config, drain, job_spec, run_all
from coserve.cluster.engine_cluster import EngineCluster, NoEngine
from coserve.cluster.routing import RoutingWeights
from coserve.contract.job_spec import JobEventKind
from coserve.contract.sampling import AdapterRef
from coserve.finetune.job import CoservedJob
from coserve.inference.request import Request, RequestStatus
from coserve.tenancy.vtc import VTCWeights
from coserving_sim import FakeClock, execute, make_request


def adapter_request(request_id: str, adapter: AdapterRef, tenant: str = "t", prompt_len: int = 6,
                    max_tokens: int = 4) -> Request:
    request = make_request(request_id, tenant, prompt_len, max_tokens)
    request.adapter = adapter
    return request


# ------------------------------------------------------------------------------ one engine

workload = st.lists(st.tuples(st.sampled_from(["request", "adapter", "job", "abort", "step"]),
                              st.integers(0, 3), st.integers(2, 20), st.integers(1, 6)),
                    min_size=1, max_size=50)


@settings(max_examples=40, deadline=None)
@given(events=workload)
def test_one_engine_plans_exactly_as_its_policy_alone(events: list[tuple[str, int, int, int]]) -> None:
    alone = builder(config(vtc=VTCWeights(w_p=1.0, w_q=2.0, w_r=1.5)))(None)
    c = cluster(1, builder(config(vtc=VTCWeights(w_p=1.0, w_q=2.0, w_r=1.5))),
                weights=VTCWeights(w_p=1.0, w_q=2.0, w_r=1.5))
    ids: list[str] = []
    jobs = 0
    for n, (kind, tenant, prompt, tokens) in enumerate(events + [("step", 0, 1, 1)] * 30):
        if kind in ("request", "adapter"):
            pair = [make_request(f"r{n}", f"t{tenant}", prompt, tokens) for _ in range(2)]
            if kind == "adapter":
                for r in pair:
                    r.adapter = AdapterRef(7 + tenant % 2, f"a{tenant % 2}", f"/a/{tenant % 2}")
            alone.add_request(pair[0])
            c.submit(pair[1])
            ids.append(pair[0].request_id)
        elif kind == "job" and jobs < 2:
            spec = job_spec(f"j{n}", f"t{tenant}", lengths=(prompt + 4,), n_epochs=2, adapter_id=50 + jobs)
            alone.jobs.add(CoservedJob(spec, alone.jobs.kv, alone.adapters))
            c.jobs.start(spec)
            jobs += 1
        elif kind == "abort" and ids:
            victim = ids[tenant % len(ids)]
            assert alone.abort(victim) == c.abort(victim)
        else:
            plan = alone.plan()
            alone.update(plan, execute(plan))
            engine = FakeEngine()
            c.step("e0", engine)
            assert engine.plans == [plan]
            assert alone.vtc.counters() == c.vtc.counters()
            assert alone.vtc.backlogged == c.vtc.backlogged


# ------------------------------------------------------------------------------ routing

def test_requests_go_to_the_least_loaded_engine() -> None:
    c = cluster(3)
    engines = [c.submit(make_request(f"r{i}", "t", 8, 4)) for i in range(6)]
    assert sorted(engines) == ["e0", "e0", "e1", "e1", "e2", "e2"]
    c.abort("r0")
    c.abort("r3")  # e0 and e1 each lose one: e0 first by id
    assert c.submit(make_request("r6", "t", 8, 4)) == "e0"


def test_an_adapter_sticks_to_its_engine_until_the_load_gap_outweighs_the_affinity() -> None:
    c = cluster(2, routing=RoutingWeights(adapter_affinity=0.5))  # half a batch: two requests of 4
    lora = AdapterRef(9, "lora", "/lora")
    placed = [c.submit(adapter_request(f"a{i}", lora, prompt_len=1)) for i in range(4)]
    # e0 takes a second request (2/4 + 2/64 - 1/2 > 0 only from the third), then e1 loads it too and
    # holds it as well.
    assert placed == ["e0", "e0", "e1", "e1"]
    assert c.last_route is not None and c.last_route.adapter_resident
    assert c.submit(make_request("base", "t", 1, 1)) == "e0"  # a tie in load: no affinity, e0 by id


def test_a_cached_prefix_draws_its_requests() -> None:
    c = cluster(2)
    prompt = list(range(100, 140))  # 40 tokens: 9 full blocks of 4 are cacheable
    first = Request("p0", prompt, make_request("x").sampling, tenant="t")
    assert c.submit(first) == "e0"
    drain(c)
    assert c.submit(make_request("other", "t", 8, 4)) == "e0"  # both idle: e0 by id
    again = Request("p1", prompt + [7], make_request("x").sampling, tenant="t")
    assert c.submit(again) == "e0"  # e0 is busier by one request, but holds 40 of its 41 tokens
    assert c.last_route is not None and c.last_route.prefix_tokens == 40


def test_a_fan_outs_sequences_count_their_siblings_prompt_as_cached() -> None:
    c = cluster(2, routing=RoutingWeights(prefix_affinity=4.0))
    sequences = [make_request(f"f{i}", "t", 32, 4) for i in range(3)]
    for s in sequences:
        s.parent_id = "fan"
        s.prompt_token_ids = list(sequences[0].prompt_token_ids)
    assert c.submit(sequences[0]) == "e0"
    # The third on e0: 2/4 + 64/64 queued, minus 4 x 32/64 saved = -1/2 < 0 on e1: they follow.
    assert [c.submit(s) for s in sequences[1:]] == ["e0", "e0"]
    assert c.last_route is not None and c.last_route.prefix_tokens == 32


def test_an_engine_whose_slots_are_all_pinned_is_avoided_for_a_new_adapter() -> None:
    c = cluster(2, build=builder(num_slots=1))
    c.submit(adapter_request("a0", AdapterRef(1, "a", "/a"), max_tokens=50))
    c.submit(make_request("b0", "t", 4, 50))
    c.submit(make_request("b1", "t", 4, 50))
    run_all(c)  # a0 pins e0's only slot; e1 runs b0 and b1
    # e0 has less load but its slot is pinned; e1's slot is free.
    assert c.submit(adapter_request("c0", AdapterRef(2, "c", "/c"))) == "e1"


def test_bad_input_and_missing_engines_are_refused() -> None:
    c = EngineCluster()
    with pytest.raises(NoEngine):
        c.submit(make_request("r"))
    c.add_engine("e0", builder())
    with pytest.raises(ValueError, match="already part"):
        c.add_engine("e0", builder())
    with pytest.raises(ValueError, match="counters of its own"):
        c.add_engine("e1", lambda shared: builder()(None))
    with pytest.raises(ValueError, match="weigh tokens"):
        c.add_engine("e2", builder(config(vtc=VTCWeights(w_q=3.0))))
    c.submit(make_request("r"))
    with pytest.raises(ValueError, match="already scheduled"):
        c.submit(make_request("r"))
    with pytest.raises(ValueError):
        c.submit(make_request("long", prompt_len=65))  # over max_model_len: nothing recorded
    assert c.get_request("long") is None and c.engines == ("e0",)
    with pytest.raises(ValueError, match=">= 0"):
        RoutingWeights(prefix_affinity=-1.0)


# ------------------------------------------------------------------------------ one counter

def test_a_tenant_is_backlogged_while_any_engine_queues_it() -> None:
    c = cluster(2, build=builder(config(scheduler={"max_num_seqs": 1})))
    for i in range(4):  # two on each engine; one runs, one waits on each
        c.submit(make_request(f"r{i}", "t", 4, 2))
    c.submit(make_request("u0", "u", 4, 2))
    assert "t" in c.vtc.backlogged
    while c.member("e0").policy.has_backlog("t"):
        c.step("e0", FakeEngine())
    assert c.member("e1").policy.has_backlog("t") and "t" in c.vtc.backlogged
    drain(c)
    assert c.vtc.backlogged == frozenset()


def test_all_engines_charge_one_counter() -> None:
    c = cluster(2)
    c.submit(make_request("a", "t", 10, 3))
    c.submit(make_request("b", "t", 6, 2))
    drain(c)
    w = c.vtc.weights
    assert c.vtc.counter("t") == pytest.approx(w.w_p * 16 + w.w_q * 5)
    assert [c.member(e).policy.vtc for e in c.engines] == [c.vtc, c.vtc]


# ------------------------------------------------------------------------------ jobs

def test_jobs_spread_over_engines_and_train() -> None:
    c = cluster(2)
    assert c.jobs.start(job_spec("j0", "a", adapter_id=100)) == "e0"
    assert c.jobs.start(job_spec("j1", "b", adapter_id=101)) == "e1"
    for _ in range(200):
        run_all(c)
    kinds = {(e.job_id, e.kind) for e in c.jobs.pop_events()}
    assert {("j0", JobEventKind.SUCCEEDED), ("j1", JobEventKind.SUCCEEDED)} <= kinds
    assert c.jobs.job_ids == []


def test_a_job_goes_where_its_sequences_fit_or_waits_saying_why() -> None:
    c = EngineCluster()
    c.add_engine("small", builder(config(scheduler={"max_model_len": 16}), num_blocks=4))  # 16 tokens
    c.add_engine("big", builder(num_blocks=64))
    assert c.jobs.start(job_spec("long", "a", lengths=(40,))) == "big"
    assert c.jobs.start(job_spec("huge", "a", lengths=(300,), adapter_id=101)) is None
    reason = c.jobs.waiting_reason("huge")
    assert reason is not None and "300 tokens" in reason
    assert "waiting for an engine" in c.jobs.pop_notices()[-1].message
    c.add_engine("huge-kv", builder(num_blocks=128))
    assert c.jobs.engine_of("huge") == "huge-kv"


def test_a_job_waits_for_an_adapter_slot_and_starts_when_one_ends() -> None:
    c = cluster(1, build=builder(num_slots=1))
    assert c.jobs.start(job_spec("first", "a", adapter_id=100)) == "e0"
    assert c.jobs.start(job_spec("second", "b", adapter_id=101)) is None
    assert "adapter slots" in (c.jobs.held_back("second") or "")
    for _ in range(300):
        run_all(c)
        if c.jobs.engine_of("second") is not None:
            break
    assert c.jobs.engine_of("second") == "e0"


def test_a_finished_jobs_adapter_is_published_and_served_by_another_engine() -> None:
    c = cluster(2)
    c.jobs.start(job_spec("j", "a", n_epochs=2))
    for _ in range(300):
        run_all(c)
    final = [e for e in c.jobs.pop_events() if e.kind is JobEventKind.SUCCEEDED]
    assert final and final[0].path == "/out/j/final"
    published = c.catalog.pop_publications()
    assert [(p.path, p.final) for p in published] == [("/out/j/ckpt-step-1", False),
                                                      ("/out/j/ckpt-step-2", False),
                                                      ("/out/j/final", True)]
    assert c.catalog.engines_for("/out/j/final") == {"e0", "e1"}
    c.submit(make_request("busy", "t", 4, 30))  # e0 (by id), so the adapter's request goes to e1
    model = AdapterRef(123, "ft:j", "/out/j/final")
    assert c.submit(adapter_request("use", model)) == "e1"
    step = c.step("e1", FakeEngine())
    assert [load.path for load in step.plan.adapter_loads] == ["/out/j/final"]


def test_without_shared_storage_an_adapter_is_served_only_where_it_was_delivered() -> None:
    c = cluster(2, shared_storage=False)
    c.jobs.start(job_spec("j", "a"))
    for _ in range(200):
        run_all(c)
    (publication,) = [p for p in c.catalog.pop_publications() if p.final]
    assert publication.to_deliver == ("e1",)
    model = AdapterRef(5, "ft:j", publication.path)
    for i in range(3):
        assert c.submit(adapter_request(f"u{i}", model)) == "e0"  # e1 lacks the files
    c.catalog.delivered(publication.path, "e1")
    assert c.submit(adapter_request("u3", model)) == "e1"


# ------------------------------------------------------------------------------ failover

def test_a_lost_engines_unstarted_requests_move_and_started_ones_are_stranded() -> None:
    c = cluster(2, build=builder(config(scheduler={"max_num_seqs": 1})))
    for i in range(4):
        c.submit(make_request(f"r{i}", f"t{i % 2}", 6, 5))  # r0, r2 on e0; r1, r3 on e1
    c.step("e0", FakeEngine())  # r0 gets its first token on e0; r2 waits
    failover = c.engine_lost("e0")
    assert [r.request_id for r in failover.stranded] == ["r0"]
    assert failover.rerouted == {"r2": "e1"}
    assert c.engine_of("r2") == "e1" and c.get_request("r0") is None
    assert c.engines == ("e1",)
    drain(c)  # everything left finishes on e1
    assert c.vtc.backlogged == frozenset()


def test_a_rerouted_prompt_is_charged_once() -> None:
    c = cluster(2, build=builder(config(scheduler={"max_num_seqs": 1, "max_batch_tokens": 4})))
    c.submit(make_request("long", "t", 12, 2))  # e0, prefilled in 3 chunks of 4
    c.step("e0", FakeEngine())  # admitted (charged 12 * w_p), no token yet
    charged = c.vtc.counter("t")
    assert charged == pytest.approx(12 * c.vtc.weights.w_p)
    assert c.engine_lost("e0").rerouted == {"long": "e1"}
    drain(c)
    assert c.vtc.counter("t") == pytest.approx(charged + 2 * c.vtc.weights.w_q)


def test_with_no_engine_left_requests_wait_for_the_next_one() -> None:
    c = cluster(1)
    c.submit(make_request("r", "t", 6, 3))
    failover = c.engine_lost("e0")
    assert failover.waiting == ["r"] and c.num_held == 1 and c.has_unfinished()
    assert c.vtc.backlogged == frozenset()
    with pytest.raises(NoEngine):
        c.submit(make_request("new"))
    c.add_engine("e0", builder())  # restarted
    assert c.engine_of("r") == "e0"
    drain(c)


def test_a_lost_engines_job_resumes_from_its_last_checkpoint_elsewhere() -> None:
    c = cluster(2)
    c.jobs.start(job_spec("j", "a", lengths=(12, 16), n_epochs=5))
    assert c.jobs.engine_of("j") == "e0"
    checkpoint = None
    for _ in range(400):
        run_all(c)
        checkpoint = c.jobs.checkpoints.last("j")
        if checkpoint is not None and checkpoint.step >= 4:
            break
    assert checkpoint is not None
    before = c.jobs.get("j")
    (move,) = c.engine_lost("e0").jobs
    assert (move.to_engine, move.resumed_from) == ("e1", checkpoint.path)
    job = c.jobs.get("j")
    assert job is not None and job is not before and job.position == checkpoint.position
    assert job.trained_tokens == checkpoint.trained_tokens
    step = c.step("e1", FakeEngine())
    (start,) = step.plan.training.job_starts
    assert start.resume_from == checkpoint.path
    for _ in range(400):
        run_all(c)
    assert JobEventKind.SUCCEEDED in {e.kind for e in c.jobs.pop_events() if e.job_id == "j"}


def test_a_job_without_a_checkpoint_starts_over_and_a_pending_cancel_is_honoured() -> None:
    c = cluster(2)
    c.jobs.start(job_spec("fresh", "a", n_epochs=3, adapter_id=100))
    c.jobs.start(job_spec("doomed", "b", n_epochs=3, adapter_id=101))
    c.jobs.pause("fresh")
    run_all(c)
    assert c.jobs.cancel("doomed")  # e1 is lost before its next plan tells the engine
    c.jobs.pop_events()
    c.engine_lost("e1")
    assert [e.kind for e in c.jobs.pop_events()] == [JobEventKind.CANCELLED]
    assert c.jobs.engine_of("doomed") is None
    lost = c.engine_lost("e0")
    (move,) = lost.jobs
    assert move.to_engine is None and move.resumed_from is None and "no engine" in (move.reason or "")
    c.add_engine("e2", builder())
    job = c.jobs.get("fresh")
    assert job is not None and c.jobs.engine_of("fresh") == "e2"
    run_all(c)
    assert not job.runnable  # still paused on its new engine
    c.jobs.resume("fresh")
    assert job.runnable


def test_an_engine_failure_fails_its_plan_and_the_cluster_goes_on() -> None:
    from coserve.cluster.engine_core import StepFailed
    from coserve.contract.engine import EngineFailure

    c = cluster(2)
    c.submit(make_request("a", "t", 6, 3))
    c.submit(make_request("b", "t", 6, 3))
    plan = c.next_plan("e0")
    assert plan is not None
    with pytest.raises(StepFailed):
        c.apply("e0", EngineFailure(plan.step_id, "boom"))
    assert c.abort("a", RequestStatus.FINISHED_ABORTED)
    drain(c)


# ------------------------------------------------------------------------------ late binding

def test_an_engine_with_free_slots_takes_what_another_would_keep_waiting() -> None:
    c = cluster(2, build=builder(config(scheduler={"max_num_seqs": 1})))
    for i in range(4):
        c.submit(make_request(f"r{i}", "t", 4, 8))  # r0, r2 on e0; r1, r3 on e1
    c.step("e1", FakeEngine())  # e1 runs r1; r3 waits there
    c.step("e0", FakeEngine())  # e0 runs r0; r2 waits
    c.abort("r0")  # e0's slot frees: its own r2 goes first (the older r3 waits on e1 for a slot)
    step = c.step("e0", FakeEngine())
    assert [s.request_id for s in step.plan.new_sequences] == ["r2"] and c.steals == 0
    c.abort("r2")
    step = c.step("e0", FakeEngine())  # nothing waits on e0: it takes r3 from e1
    assert [s.request_id for s in step.plan.new_sequences] == ["r3"]
    assert c.steals == 1 and c.engine_of("r3") == "e0" and c.get_request("r3") is not None
    assert c.member("e1").policy.get_request("r3") is None
    drain(c)


def test_late_binding_follows_the_counters_and_takes_overdue_requests_first() -> None:
    clock = FakeClock()
    c = cluster(2, build=builder(config(scheduler={"max_num_seqs": 2}, ttft_slo_ms=1000.0), clock=clock))
    for i in range(4):
        c.submit(make_request(f"rich-{i}", "rich", 4, 50))  # rich-0, rich-2 on e0; rich-1, rich-3 on e1
    run_all(c)  # both engines full
    assert c.submit(make_request("late-rich", "rich", 4, 2)) == "e0"
    assert c.submit(make_request("late-poor", "poor", 4, 2)) == "e1"
    c.abort("rich-0")  # e0 has a free slot; poor's counter is below rich's: e0 takes late-poor
    step = c.step("e0", FakeEngine())
    assert [s.request_id for s in step.plan.new_sequences] == ["late-poor"] and c.steals == 1
    clock.now = 10.0  # late-rich (arrived at 0) is overdue: the TTFT guard is 0.5 s
    assert c.submit(make_request("poor-2", "poor", 4, 2, arrival=10.0)) == "e1"
    c.abort("rich-1")  # e1's free slot: the overdue late-rich first, though poor-2 is cheaper
    step = c.step("e1", FakeEngine())
    assert [s.request_id for s in step.plan.new_sequences] == ["late-rich"] and c.steals == 2
    drain(c)


def test_withdraw_refuses_a_request_that_was_admitted() -> None:
    policy = builder()(None)
    policy.add_request(make_request("a", "t", 4, 4))
    policy.add_request(make_request("b", "t", 4, 4))
    assert policy.withdraw("b") is not None and policy.get_request("b") is None
    plan = policy.plan()
    policy.update(plan, execute(plan))
    assert policy.withdraw("a") is None and policy.withdraw("nobody") is None


def test_the_cluster_and_its_simulator_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, coserve.cluster.engine_cluster, coserve.bench.cluster_sim, "
            "coserve.bench.cluster_projection; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engines_with_a_shorter_context_get_only_what_fits() -> None:
    c = EngineCluster()
    c.add_engine("short", builder(config(scheduler={"max_model_len": 16})))
    c.add_engine("long", builder())
    assert c.submit(make_request("big", "t", 30, 4)) == "long"  # "short" is idle but cannot hold it
    assert c.submit(make_request("small", "t", 4, 4)) == "short"
    failover = c.engine_lost("long")  # nowhere to go: handed back like a started request
    assert [r.request_id for r in failover.stranded] == ["big"] and failover.rerouted == {}
    drain(c)


def test_an_idle_engine_has_work_when_another_keeps_requests_waiting() -> None:
    c = cluster(2, build=builder(config(scheduler={"max_num_seqs": 1})),
                routing=RoutingWeights(adapter_affinity=10.0))
    lora = AdapterRef(9, "lora", "/lora")
    assert c.submit(make_request("base", "t", 4, 8)) == "e0"
    assert [c.submit(adapter_request(f"x{i}", lora)) for i in range(2)] == ["e1", "e1"]  # affinity
    c.step("e1", FakeEngine())  # x0 runs on e1, x1 waits there
    c.abort("base")
    assert not c.member("e0").core.has_work() and c.has_work("e0")
    step = c.step("e0", FakeEngine())
    assert [s.request_id for s in step.plan.new_sequences] == ["x1"] and c.steals == 1
    drain(c)
