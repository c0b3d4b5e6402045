"""`JobHost`: one job host for the co-serving policy and offline fine-tuning; a policy says whether it
runs jobs by its `jobs` attribute (a JobHost, or None)."""

from __future__ import annotations

from coserve.contract.job_spec import JobEventKind
from coserve.contract.plan import IterationPlan
from coserve.finetune.host import JobHost
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.planner import InferencePlanner
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.share_kinds import ShareKind
from coserve.tenancy.vtc import VirtualTokenCounter, VTCWeights
from coserving_sim import BS, make_job, make_policy, make_request, step


def _host(also: set[str] | None = None, weight: float = 1.0) -> tuple[JobHost, VirtualTokenCounter]:
    vtc = VirtualTokenCounter(VTCWeights())
    host = JobHost(vtc, KVBlockManager(64, BS), AdapterSlots(2), default_weight=weight,
                   also_backlogged=lambda tenant: tenant in (also or set()))
    return host, vtc


def test_a_job_registers_its_tenant_and_backlogs_it_while_runnable() -> None:
    host, vtc = _host(weight=3.0)
    policy = make_policy()
    job = make_job(policy, "j", "acme")
    host.add(job)
    assert vtc.weight("acme") == 3.0 and "acme" in vtc.backlogged
    assert host.get("j") is job and host.has_work and host.has_runnable_job()
    assert host.pause("j")
    host.roster.apply_control(IterationPlan(step_id=0))  # the pause lands in the next plan
    assert "acme" not in vtc.backlogged and not host.has_runnable_job()
    assert host.resume("j") and "acme" in vtc.backlogged


def test_other_backlog_keeps_a_tenant_backlogged_without_runnable_jobs() -> None:
    host, vtc = _host(also={"acme"})
    vtc.add_tenant("acme")
    host.sync_backlog("acme")
    assert "acme" in vtc.backlogged
    host, vtc = _host()
    vtc.add_tenant("acme")
    host.sync_backlog("acme")
    assert "acme" not in vtc.backlogged


def test_cancelling_reports_an_event_and_unknown_ids_are_refused() -> None:
    host, _ = _host()
    host.add(make_job(make_policy(), "j", "acme"))
    assert host.cancel("j") and not host.cancel("nope")
    assert not host.pause("nope") and not host.resume("nope")
    host.roster.apply_control(IterationPlan(step_id=0))
    assert [e.kind for e in host.pop_events()] == [JobEventKind.CANCELLED]
    assert host.get("j") is None and not host.has_work


def test_the_policy_says_by_its_jobs_attribute_whether_it_runs_jobs() -> None:
    assert isinstance(make_policy(ShareKind.HYBRID).jobs, JobHost)
    assert isinstance(make_policy(ShareKind.STATIC_SPLIT).jobs, JobHost)
    assert make_policy(ShareKind.NONE).jobs is None
    inference = InferencePlanner(SchedulerConfig(max_model_len=64, block_size=BS), KVBlockManager(64, BS),
                                   AdapterSlots(1))
    assert inference.jobs is None


def test_the_policy_reports_why_it_held_jobs_back_on_its_host() -> None:
    policy = make_policy(tpot_slo_ms=8.0, scheduler={"max_num_seqs": 8})
    for i in range(8):  # 8 decodes take the 8 ms SLO
        policy.add_request(make_request(f"r{i}", "bob", prompt_len=1, max_tokens=60))
    step(policy)
    assert policy.jobs is not None
    policy.jobs.add(make_job(policy, "j", "acme", lengths=(400,)))
    step(policy)
    assert policy.jobs.finetune_held_back is not None
    assert "predicted iteration" in policy.jobs.finetune_held_back
