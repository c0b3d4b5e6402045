"""A fake engine and builders for the co-serving policy tests: plans are 'executed' by hand, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan, IterationResult, SampledToken, StepTimings
from coserve.contract.sampling import SamplingParams
from coserve.contract.training_plan import SavedAdapter, StepReport, TrainingExample, TrainingReport
from coserve.finetune.job import CoservedJob
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.request import Request
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.planner.latency import LatencyModel, ModelFingerprint
from coserve.planner.policy import CoServingPolicy
from coserve.planner.settings import CoServingConfig
from coserve.planner.share_kinds import ShareKind, build_policy

BS = 4
TOKEN = 50
FP = ModelFingerprint("m", "machine", "float32")
# 1 ms per decode, 0.5 ms per prefill token, 0.1 ms per forward-window token, 0.01 ms per token-layer.
COEFFICIENTS = {"decode_tokens": 1e-3, "prefill_tokens": 5e-4, "ft_forward_tokens": 1e-4,
                "ft_backward_token_layers": 1e-5}


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def make_policy(kind: ShareKind = ShareKind.HYBRID, *, num_blocks: int = 64,
                num_slots: int = 4, coefficients: dict[str, float] | None = None,
                clock: FakeClock | None = None, scheduler: dict[str, Any] | None = None,
                **co: Any) -> CoServingPolicy:
    sched = {"max_model_len": 64, "block_size": BS, "max_num_seqs": 8, "max_batch_tokens": 64,
             **(scheduler or {})}
    co.setdefault("tpot_slo_ms", 20.0)
    co.setdefault("safety_margin", 0.0)
    config = CoServingConfig(scheduler=SchedulerConfig(**sched), **co)
    latency = LatencyModel(FP, COEFFICIENTS if coefficients is None else coefficients)
    return build_policy(kind, config, num_blocks, AdapterSlots(num_slots), latency,
                        clock=clock or FakeClock())


def make_request(request_id: str, tenant: str = "default", prompt_len: int = 6, max_tokens: int = 4,
                 arrival: float = 0.0) -> Request:
    base = 1000 * sum(map(ord, request_id))
    return Request(request_id, [base + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant,
                   arrival_time=arrival)


def make_job(policy: CoServingPolicy, job_id: str, tenant: str, *, lengths: tuple[int, ...] = (24,),
             n_epochs: int = 1, num_layers: int = 4, adapter_id: int = 100,
             max_window_tokens: int = 256) -> CoservedJob:
    examples = [TrainingExample(list(range(1, n + 1)), [False] + [True] * (n - 1)) for n in lengths]
    spec = FinetuneJobSpec(job_id=job_id, tenant=tenant, adapter_id=adapter_id, examples=examples,
                           n_epochs=n_epochs, batch_size=len(lengths), seed=0, num_layers=num_layers,
                           output_dir=f"/out/{job_id}", max_window_tokens=max_window_tokens,
                           min_tasklet_tokens=1)
    return CoservedJob(spec, policy.jobs.kv, policy.adapters)


def execute(plan: IterationPlan, total_s: float = 0.0) -> IterationResult:
    """What an engine would report: TOKEN for every sampled chunk, every optimizer step and save done."""
    training = plan.training
    report = TrainingReport(
        steps=[StepReport(s.job_id, s.step, 1.0, 1.0, 1e-4, s.num_sequences, s.num_tokens)
               for s in training.optimizer_steps],
        saved=[SavedAdapter(s.job_id, s.path, s.step) for s in training.saves])
    return IterationResult(step_id=plan.step_id,
                           sampled=[SampledToken(c.request_id, TOKEN) for c in plan.chunks if c.sample],
                           num_tokens=plan.num_tokens, timings=StepTimings(total_s=total_s),
                           training=report)


def keep_busy(policy: CoServingPolicy, tenant: str = "busy", max_tokens: int = 60) -> Request:
    """Admit one long request (1-token prompt, then a decode per iteration at 1 ms), so the TPOT SLO
    binds: an idle engine gives fine-tuning the whole iteration whatever the latency model says."""
    request = make_request("busy", tenant, prompt_len=1, max_tokens=max_tokens)
    policy.add_request(request)
    step(policy)  # its prefill
    return request


def step(policy: CoServingPolicy, total_s: float = 0.0) -> tuple[IterationPlan, list[Request]]:
    plan = policy.plan()
    return plan, policy.update(plan, execute(plan, total_s))
