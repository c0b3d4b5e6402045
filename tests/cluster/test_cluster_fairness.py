"""FlexLLM Algorithm 4's fairness across engines, and liveness, under the cluster scheduler (hypothesis).

Several fake engines step at different speeds (a drawn schedule of which engine steps when); tenants
are kept backlogged with requests the router spreads (some through adapters, so affinity pulls them),
and every tenant's service is counted from the plans and results of all engines (not read from the
counters): w_p per prompt token when a request is first sent, w_q per sampled token, w_r per
forward-window token and per backward token-layer / num_layers.

* fairness: a tenant's service over the whole machine follows its weight, whichever engines served it;
  two backlogged tenants' services stay within Theorem 1's bound with the N running batches' tokens as
  the quantum (without late binding, `work_stealing`, a tenant kept on the slower engine by its
  adapter's affinity fell behind without bound here);
* liveness: every request and job on every engine makes progress: after arrivals stop, every request
  finishes and every job completes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_sim import FakeEngine, builder, cluster, config, job_spec
from coserve.cluster.engine_cluster import EngineCluster
from coserve.contract.job_spec import JobEventKind
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.sampling import AdapterRef
from coserve.tenancy.vtc import VTCWeights
from coserving_sim import make_request

NUM_LAYERS = 4


@dataclass
class Ledger:
    """Weighted service per tenant over every engine, counted from what the engines were told to do."""

    weights: VTCWeights
    service: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_engine: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    seen: set[str] = field(default_factory=set)
    owner: dict[str, str] = field(default_factory=dict)  # request id or job id -> tenant
    waiting: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # added, never sent

    def record(self, engine: str, plan: IterationPlan, result: IterationResult) -> None:
        w = self.weights
        for seq in plan.new_sequences:
            if seq.request_id not in self.seen:
                self.seen.add(seq.request_id)
                self.waiting[self.owner[seq.request_id]] -= 1
                self._add(engine, self.owner[seq.request_id], w.w_p * len(seq.token_ids))
        for token in result.sampled:
            self._add(engine, self.owner[token.request_id], w.w_q)
        for window in plan.training.forward_windows:
            self._add(engine, self.owner[window.sequence_id.split("/")[0]], w.w_r * window.num_tokens)
        for tasklet in plan.training.backward_tasklets:
            tenant = self.owner[tasklet.sequence_id.split("/")[0]]
            self._add(engine, tenant, w.w_r * tasklet.token_layers / NUM_LAYERS)

    def _add(self, engine: str, tenant: str, amount: float) -> None:
        self.service[tenant] += amount
        self.by_engine[tenant, engine] += amount


class Driver:
    """Keeps tenants backlogged cluster-wide and steps the engines in a drawn order."""

    def __init__(self, c: EngineCluster, prompt_len: int, max_tokens: int, depth: int,
                 adapters: dict[str, AdapterRef]) -> None:
        self.c, self.prompt_len, self.max_tokens, self.depth = c, prompt_len, max_tokens, depth
        self.adapters = adapters
        self.ledger = Ledger(c.vtc.weights)
        self.count = 0
        self.busy: set[str] = set()

    def add(self, tenant: str) -> None:
        request = make_request(f"{tenant}-{self.count}", tenant, self.prompt_len, self.max_tokens)
        request.adapter = self.adapters.get(tenant)
        self.count += 1
        self.ledger.waiting[tenant] += 1
        self.ledger.owner[request.request_id] = tenant
        self.c.submit(request)

    def step(self, engine: str) -> None:
        for tenant in sorted(self.busy):
            for _ in range(self.depth - self.ledger.waiting.get(tenant, 0)):
                self.add(tenant)
        if not self.c.has_work(engine):
            return
        fake = FakeEngine()
        step = self.c.step(engine, fake)
        self.ledger.record(engine, step.plan, step.result)


def _cluster(engines: int, shares: dict[str, float], weights: VTCWeights, max_num_seqs: int,
             num_slots: int = 4) -> EngineCluster:
    cfg = config(scheduler={"max_num_seqs": max_num_seqs, "max_batch_tokens": 64}, vtc=weights,
                 tenant_weights=shares, tpot_slo_ms=1000.0)
    return cluster(engines, builder(cfg, num_blocks=256, num_slots=num_slots), weights=weights,
                   tenant_weights=shares)


token_weight = st.floats(min_value=0.5, max_value=3.0, allow_nan=False)
vtc_weights = st.builds(VTCWeights, w_p=token_weight, w_q=token_weight, w_r=token_weight)
# Which engine steps at each tick, repeated: [0, 0, 1] makes engine 0 twice as fast as engine 1.
speeds = st.lists(st.integers(0, 2), min_size=2, max_size=6)


@settings(max_examples=12, deadline=None)
@given(weights=vtc_weights, schedule=speeds, engines=st.integers(2, 3),
       with_adapter=st.sets(st.sampled_from("abc"), max_size=2), prompt_len=st.integers(2, 16),
       max_tokens=st.integers(1, 8))
def test_service_follows_the_weights_whichever_engine_served_it(
        weights: VTCWeights, schedule: list[int], engines: int, with_adapter: set[str], prompt_len: int,
        max_tokens: int) -> None:
    shares = {"a": 1.0, "b": 2.0, "c": 3.0}
    c = _cluster(engines, shares, weights, max_num_seqs=4)
    adapters = {t: AdapterRef(10 + i, t, f"/lora/{t}") for i, t in enumerate(sorted(with_adapter))}
    driver = Driver(c, prompt_len, max_tokens, depth=engines * 4 + 1, adapters=adapters)
    driver.busy = set(shares)
    order = [f"e{i % engines}" for i in schedule]
    for tick in range(1500):
        driver.step(order[tick % len(order)])
    total = sum(driver.ledger.service.values())
    for tenant, share in shares.items():
        # VTC's lag bound per engine (a few requests' tokens each) against 1500 ticks of service: under 5%
        assert driver.ledger.service[tenant] / total == pytest.approx(share / sum(shares.values()), rel=0.05)
    # The engines served the tenants in different proportions (a tenant's adapter may keep it on the
    # fastest engine), and still each got its weight's share of the machine.
    assert len({e for (_, e), v in driver.ledger.by_engine.items() if v > 0}) == len(set(order))


@settings(max_examples=12, deadline=None)
@given(weights=vtc_weights, schedule=speeds, engines=st.integers(2, 3), prompt_len=st.integers(2, 24),
       max_tokens=st.integers(1, 12), max_num_seqs=st.integers(1, 4), adapter=st.booleans())
def test_two_backlogged_tenants_stay_within_theorem_1_across_engines(
        weights: VTCWeights, schedule: list[int], engines: int, prompt_len: int, max_tokens: int,
        max_num_seqs: int, adapter: bool) -> None:
    c = _cluster(engines, {"f": 1.0, "g": 1.0}, weights, max_num_seqs)
    adapters = {"f": AdapterRef(3, "f", "/lora/f")} if adapter else {}
    driver = Driver(c, prompt_len, max_tokens, depth=engines * max_num_seqs + 1, adapters=adapters)
    driver.busy = {"f", "g"}
    # M: the tokens the N running batches can hold (VTC's M with one counter over N engines).
    bound = 2 * weights.fairness_bound(prompt_len, engines * max_num_seqs * (prompt_len + max_tokens))
    order = [f"e{i % engines}" for i in schedule]
    lo = hi = 0.0
    for tick in range(600):
        driver.step(order[tick % len(order)])
        gap = driver.ledger.service["f"] - driver.ledger.service["g"]
        lo, hi = min(lo, gap), max(hi, gap)
        assert hi - lo <= bound + 1e-9  # every interval [t1, t2] of the run


events = st.lists(st.tuples(st.sampled_from(["request", "adapter", "job", "tick", "lose"]),
                            st.integers(0, 5)), min_size=5, max_size=60)


@settings(max_examples=30, deadline=None)
@given(events=events, schedule=speeds, engines=st.integers(2, 3))
def test_every_request_and_job_on_every_engine_makes_progress(events: list[tuple[str, int]],
                                                              schedule: list[int], engines: int) -> None:
    cfg = config(scheduler={"max_num_seqs": 3, "max_batch_tokens": 32, "max_model_len": 48},
                 tpot_slo_ms=50.0)
    c = cluster(engines, builder(cfg, num_blocks=64, num_slots=2))
    requests, jobs, lost, joined = [], [], 0, engines
    order = schedule
    for n, (kind, k) in enumerate(events):
        live = c.engines
        if kind in ("request", "adapter"):
            request = make_request(f"r{n}", f"t{k % 3}", 4 + k, 2 + k)
            if kind == "adapter":
                request.adapter = AdapterRef(20 + k % 3, f"l{k % 3}", f"/lora/{k % 3}")
            c.submit(request)
            requests.append(request)
        elif kind == "job" and len(jobs) < 3:
            spec = job_spec(f"j{n}", f"t{k % 3}", lengths=(10 + k, 12), n_epochs=2, adapter_id=40 + len(jobs))
            c.jobs.start(spec)
            jobs.append(spec.job_id)
        elif kind == "lose" and len(live) > 1 and lost < 2:  # an engine dies; its work moves
            failover = c.engine_lost(live[k % len(live)])
            lost += 1
            for request in failover.stranded:  # the caller ends these streams with an error
                requests.remove(request)
            c.add_engine(f"e{joined}", builder(cfg, num_blocks=64, num_slots=2))  # restarted
            joined += 1
        else:
            engine = c.engines[order[n % len(order)] % len(c.engines)]
            if c.has_work(engine):
                c.step(engine, FakeEngine())
    ended: set[str] = set()
    for _tick in range(3000):  # no more arrivals: everything must finish, on every engine
        for engine in c.engines:
            if c.has_work(engine):
                c.step(engine, FakeEngine())
        ended |= {e.job_id for e in c.jobs.pop_events() if e.kind is JobEventKind.SUCCEEDED}
        if not c.has_unfinished() and ended >= set(jobs):
            break
    assert all(r.is_finished and r.num_output_tokens > 0 for r in requests)
    assert ended == set(jobs)
    assert c.vtc.backlogged == frozenset()
