"""Builders for the cluster scheduler tests: engines whose policies share the cluster's counters, and a
fake engine per member (plans 'executed' by hand, no torch), as `coserving_sim` does for one policy."""

from __future__ import annotations

from typing import Any

from coserve.cluster.engine_cluster import EngineCluster, PolicyBuilder
from coserve.cluster.engine_core import Step
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.training_plan import TrainingExample
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserve.planner.share_kinds import ShareKind, build_policy
from coserve.tenancy.shared_vtc import SharedVtc
from coserving_sim import BS, COEFFICIENTS, FP, FakeClock, execute


def config(scheduler: dict[str, Any] | None = None, **co: Any) -> CoServingConfig:
    sched = {"max_model_len": 64, "block_size": BS, "max_num_seqs": 4, "max_batch_tokens": 64,
             **(scheduler or {})}
    co.setdefault("tpot_slo_ms", 20.0)
    co.setdefault("safety_margin", 0.0)
    return CoServingConfig(scheduler=SchedulerConfig(**sched), **co)


def builder(cfg: CoServingConfig | None = None, *, num_blocks: int = 64, num_slots: int = 2,
            clock: FakeClock | None = None, kind: ShareKind = ShareKind.HYBRID) -> PolicyBuilder:
    """A `PolicyBuilder` of co-serving policies over a fake engine of `num_blocks` KV blocks."""
    cfg = cfg or config()

    def build(shared: SharedVtc | None) -> CoServingPolicy:
        return build_policy(kind, cfg, num_blocks, AdapterSlots(num_slots), LatencyModel(FP, dict(COEFFICIENTS)),
                            clock=clock or FakeClock(), shared=shared)
    return build


def cluster(engines: int = 2, build: PolicyBuilder | None = None, **kwargs: Any) -> EngineCluster:
    """A cluster of `engines` fake engines e0, e1, ..."""
    c = EngineCluster(**kwargs)
    for i in range(engines):
        c.add_engine(f"e{i}", build or builder())
    return c


class FakeEngine:
    """Executes plans by hand (`coserving_sim.execute`) and keeps them."""

    def __init__(self) -> None:
        self.plans: list[IterationPlan] = []

    def step(self, plan: IterationPlan) -> IterationResult:
        self.plans.append(plan)
        return execute(plan)


def run_all(c: EngineCluster, steps: int = 1) -> list[Step]:
    """`steps` rounds: every engine with work steps once, in join order."""
    done = []
    for _ in range(steps):
        for engine_id in c.engines:
            if c.has_work(engine_id):
                done.append(c.step(engine_id, FakeEngine()))
    return done


def drain(c: EngineCluster, max_rounds: int = 2000) -> None:
    """Step every engine until no request is unfinished (jobs may still train)."""
    for _ in range(max_rounds):
        if not c.has_unfinished():
            return
        run_all(c)
    raise AssertionError("requests still unfinished after draining")


def job_spec(job_id: str, tenant: str, *, lengths: tuple[int, ...] = (24,), n_epochs: int = 1,
             adapter_id: int = 100, num_layers: int = 4) -> FinetuneJobSpec:
    examples = [TrainingExample(list(range(1, n + 1)), [False] + [True] * (n - 1)) for n in lengths]
    return FinetuneJobSpec(job_id=job_id, tenant=tenant, adapter_id=adapter_id, examples=examples,
                           n_epochs=n_epochs, batch_size=1, seed=0, num_layers=num_layers,
                           output_dir=f"/out/{job_id}", min_tasklet_tokens=1)
