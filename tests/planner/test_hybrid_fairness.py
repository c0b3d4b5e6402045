"""FlexLLM Algorithm 4's properties at the policy level (hypothesis): the co-serving policy with the
hybrid share is driven by a fake engine, and every tenant's service is counted from the plans and
results themselves (not read from the counters): w_p per prompt token when a request is first sent,
w_q per sampled token, w_r per forward-window token and per backward token-layer / num_layers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.contract.plan import IterationPlan, IterationResult
from coserve.planner.policy import CoServingPolicy
from coserve.tenancy.vtc import VTCWeights
from coserving_sim import execute, make_job, make_policy, make_request

NUM_LAYERS = 4


@dataclass
class Ledger:
    """Weighted service per tenant, counted from what the engine was told to do."""

    policy: CoServingPolicy
    service: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    seen: set[str] = field(default_factory=set)
    owner: dict[str, str] = field(default_factory=dict)  # request id or job id -> tenant
    waiting: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # added, never sent

    def record(self, plan: IterationPlan, result: IterationResult) -> None:
        w = self.policy.vtc.weights
        for seq in plan.new_sequences:
            if seq.request_id not in self.seen:
                self.seen.add(seq.request_id)
                self.waiting[self.owner[seq.request_id]] -= 1
                self.service[self.owner[seq.request_id]] += w.w_p * len(seq.token_ids)
        for token in result.sampled:
            self.service[self.owner[token.request_id]] += w.w_q
        for window in plan.training.forward_windows:
            self.service[self.owner[window.sequence_id.split("/")[0]]] += w.w_r * window.num_tokens
        for tasklet in plan.training.backward_tasklets:
            tenant = self.owner[tasklet.sequence_id.split("/")[0]]
            self.service[tenant] += w.w_r * tasklet.token_layers / NUM_LAYERS

    def normalized(self, tenant: str) -> float:
        return self.service[tenant] / self.policy.vtc.weight(tenant)


class Driver:
    """Keeps chosen tenants backlogged (`depth` waiting requests each) and runs the policy."""

    def __init__(self, policy: CoServingPolicy, prompt_len: int, max_tokens: int) -> None:
        self.policy, self.prompt_len, self.max_tokens = policy, prompt_len, max_tokens
        # More waiting than one plan can admit: a busy tenant's queue never empties (backlogged).
        self.depth = policy._co.scheduler.max_num_seqs + 1  # noqa: SLF001
        self.ledger = Ledger(policy)
        self.count = 0
        self.busy: set[str] = set()

    def add(self, tenant: str) -> None:
        request = make_request(f"{tenant}-{self.count}", tenant, self.prompt_len, self.max_tokens)
        self.count += 1
        self.ledger.waiting[tenant] += 1
        self.ledger.owner[request.request_id] = tenant
        self.policy.add_request(request)


    def add_job(self, tenant: str, adapter_id: int, lengths: tuple[int, ...] = (40, 24)) -> None:
        job = make_job(self.policy, f"job{adapter_id}", tenant, lengths=lengths, n_epochs=10_000,
                       num_layers=NUM_LAYERS, adapter_id=adapter_id)
        self.ledger.owner[job.job_id] = tenant
        self.policy.jobs.add(job)

    def step(self) -> IterationPlan:
        for tenant in self.busy:
            for _ in range(self.depth - self.ledger.waiting.get(tenant, 0)):
                self.add(tenant)
        plan = self.policy.plan()
        result = execute(plan)
        self.policy.update(plan, result)
        self.ledger.record(plan, result)
        return plan


def inference_policy(weights: VTCWeights, shares: dict[str, float], max_num_seqs: int = 4) -> CoServingPolicy:
    return make_policy(num_blocks=256, tpot_slo_ms=1000.0, vtc=weights, tenant_weights=shares,
                       scheduler={"max_num_seqs": max_num_seqs, "max_batch_tokens": 64})


def assert_shares_after(driver: Driver, shares: dict[str, float], steps: int) -> None:
    """Run the backlogged tenants; each tenant's service must be its weight's share, within 5 %."""
    for _ in range(steps):
        driver.step()
    total = sum(driver.ledger.service.values())
    for tenant, share in shares.items():
        # VTC's lag bound (a few requests' tokens) against `steps` iterations of service: under 5%
        assert driver.ledger.service[tenant] / total == pytest.approx(share / sum(shares.values()),
                                                                      rel=0.05)


token_weight = st.floats(min_value=0.5, max_value=3.0, allow_nan=False)
vtc_weights = st.builds(VTCWeights, w_p=token_weight, w_q=token_weight, w_r=token_weight)


@settings(max_examples=15, deadline=None)
@given(weights=vtc_weights, prompt_len=st.integers(2, 24), max_tokens=st.integers(1, 12))
def test_weights_1_2_3_give_inference_service_1_2_3(weights: VTCWeights, prompt_len: int,
                                                    max_tokens: int) -> None:
    shares = {"a": 1.0, "b": 2.0, "c": 3.0}
    driver = Driver(inference_policy(weights, shares), prompt_len, max_tokens)
    driver.busy = set(shares)
    assert_shares_after(driver, shares, steps=1500)


@settings(max_examples=8, deadline=None)
@given(weights=vtc_weights, slo_ms=st.floats(min_value=1.0, max_value=4.0))
def test_weights_1_2_3_give_fine_tuning_service_1_2_3(weights: VTCWeights, slo_ms: float) -> None:
    # 10 to 40 forward tokens (or 100 to 400 token-layers) per iteration: the picked job can use it
    # all. (Each job runs one window per iteration, so a budget larger than one
    # job's window is shared by the next jobs: work conservation, as in Algorithm 4 lines 22-27.)
    shares = {"a": 1.0, "b": 2.0, "c": 3.0}
    policy = make_policy(num_blocks=256, tpot_slo_ms=slo_ms, vtc=weights, tenant_weights=shares,
                         scheduler={"max_num_seqs": 1, "max_batch_tokens": 64})
    driver = Driver(policy, 4, 1)
    for k, tenant in enumerate(shares):
        driver.add_job(tenant, adapter_id=10 + k, lengths=(400, 240))
    assert_shares_after(driver, shares, steps=1500)


@settings(max_examples=15, deadline=None)
@given(weights=vtc_weights, prompt_len=st.integers(2, 30), max_tokens=st.integers(1, 16),
       max_num_seqs=st.integers(1, 6))
def test_two_backlogged_tenants_stay_within_theorem_1(weights: VTCWeights, prompt_len: int,
                                                      max_tokens: int, max_num_seqs: int) -> None:
    policy = inference_policy(weights, {"f": 1.0, "g": 1.0}, max_num_seqs)
    driver = Driver(policy, prompt_len, max_tokens)
    driver.busy = {"f", "g"}
    # M: the tokens the running batch can hold (VTC's M), here max_num_seqs full-length requests.
    bound = 2 * weights.fairness_bound(prompt_len, max_num_seqs * (prompt_len + max_tokens))
    lo = hi = 0.0
    for _ in range(400):
        driver.step()
        gap = driver.ledger.service["f"] - driver.ledger.service["g"]
        lo, hi = min(lo, gap), max(hi, gap)
        assert hi - lo <= bound + 1e-9  # every interval [t1, t2] of the run


@settings(max_examples=15, deadline=None)
@given(idle_steps=st.integers(5, 200), prompt_len=st.integers(2, 16), max_tokens=st.integers(1, 8))
def test_tenant_returning_from_idle_gets_no_credit_beyond_the_lift(idle_steps: int, prompt_len: int,
                                                                  max_tokens: int) -> None:
    weights = VTCWeights()
    policy = inference_policy(weights, {})
    driver = Driver(policy, prompt_len, max_tokens)
    driver.busy = {"a", "b", "late"}
    for _ in range(20):
        driver.step()
    driver.busy.discard("late")  # "late" goes idle while a and b keep being served
    for _ in range(idle_steps):
        driver.step()
    while driver.ledger.waiting["late"]:  # "late" is idle once its queue drains
        driver.step()
    floor = min(policy.vtc.counter("a"), policy.vtc.counter("b"))
    start = dict(driver.ledger.service)
    driver.busy.add("late")
    driver.step()
    assert policy.vtc.counter("late") >= floor  # the lift
    for _ in range(300):
        driver.step()
    gained = {t: driver.ledger.service[t] - start.get(t, 0.0) for t in ("a", "b", "late")}
    # From its return on, "late" is one of three backlogged tenants: Theorem 1 against each other.
    bound = 2 * weights.fairness_bound(prompt_len, 4 * (prompt_len + max_tokens))
    assert gained["late"] - min(gained["a"], gained["b"]) <= bound + 1e-9


@settings(max_examples=25, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["request", "job", "step"]), st.integers(0, 3)),
                       min_size=5, max_size=60))
def test_policy_is_work_conserving(events: list[tuple[str, int]]) -> None:
    """Whenever a request waits or a job has work, the plan computes something."""
    policy = make_policy(num_blocks=64, tpot_slo_ms=50.0,
                         scheduler={"max_num_seqs": 3, "max_batch_tokens": 32, "max_model_len": 48})
    driver = Driver(policy, 8, 3)
    jobs = 0
    for kind, tenant_index in events + [("step", 0)] * 40:
        tenant = f"t{tenant_index}"
        if kind == "request":
            driver.add(tenant)
        elif kind == "job" and jobs < 3:
            driver.add_job(tenant, adapter_id=20 + jobs, lengths=(12,))
            jobs += 1
        else:
            has_work = policy.num_waiting > 0 or policy.has_runnable_job()
            plan = driver.step()
            computes = plan.chunks or plan.training.forward_windows or plan.training.backward_tasklets \
                or plan.training.optimizer_steps or plan.training.saves
            assert computes or not has_work
