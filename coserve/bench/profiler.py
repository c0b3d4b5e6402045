"""The latency profiler: a designed sweep of real engine iterations, fitted and checked on held-out ones.

Each measured iteration is built by hand (no policy: `DesignedPlans` is the `EngineCore`'s plan source): some
decodes at chosen contexts, at most one prefill chunk at a chosen start, sequences spread over 0..`adapters` LoRA
adapters, and a fine-tuning job's forward window or backward tasklets of chosen sizes. Every measured iteration
holds inference work (decodes or a prefill chunk): the latency model only ever decides iterations that do (an engine
with no request running or waiting gives fine-tuning the whole iteration, whatever the model says), and fine-tuning
alone is a different iteration (a backward-only one runs no forward pass at all); fitted together, those iterations
pulled the per-iteration constant and doubled the error on the others (SmolLM2, CPU time: 5-fold MAPE 9.5% with
them, 4.8% without; benchmarks/RESULTS.md). The measured iteration does exactly the work its features count
(`plan_features`): its sequences get KV blocks for their earlier tokens, and unmeasured iterations bring the job to
the wanted phase. The earlier tokens' K/V are not computed: attention costs the same whatever values the blocks hold
(dense kernels, no data-dependent branch; the cache starts zeroed and later holds finite K/V of earlier sequences),
and computing them cost more than the sweep itself (a 30-layer model spent minutes filling 512-token contexts for 32
decodes). Iterations in which the job's optimizer step runs are measured but left out: no feature counts an
optimizer step (it happens once per batch, not per token, and the policy does not plan it against the SLO). The
sweep runs `repeats` times and each scenario keeps its fastest run, so that a burst of load from another process on
the machine does not make a sample.

The samples are split at random (seeded) into a fit set and a held-out set; `LatencyModel.fit` runs
on the first and `heldout_mape` on the second.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from coserve.backends.registry import BuiltEngine
from coserve.cluster.engine_core import EngineCore, Step
from coserve.contract.job_spec import FinetuneJobSpec, JobPhase
from coserve.contract.plan import IterationPlan, IterationResult, NewSequence, ScheduledChunk
from coserve.contract.sampling import AdapterRef, SamplingParams
from coserve.contract.training_plan import TrainingExample
from coserve.contract.training_settings import LoRASettings
from coserve.finetune.job import CoservedJob
from coserve.finetune.pieces import JobPieces
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.request import Request
from coserve.planner.latency import LatencyModel, ModelFingerprint, Sample, plan_features

if TYPE_CHECKING:
    import torch

SETUP_TOKENS = 1024  # fine-tuning tokens per iteration that brings the job to a phase
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@runtime_checkable
class TypedEngine(BuiltEngine, Protocol):
    """A built engine with the dtype it computes in, which the latency model's fingerprint names: every
    backend's (`TorchEngine`, `VllmEngine`) has one."""

    dtype: torch.dtype


def typed_engine(engine: BuiltEngine) -> TypedEngine:
    """`engine` (`build_engine`'s) as a `TypedEngine`."""
    if not isinstance(engine, TypedEngine):
        raise TypeError(f"{type(engine).__name__} does not report its dtype")
    return engine


@dataclass(frozen=True, slots=True)
class SweepSettings:
    """The designed sweep: the levels each factor takes (drawn at random per iteration, seeded)."""

    iterations: int = 160
    heldout_fraction: float = 0.25
    seed: int = 0
    warmup: int = 8
    repeats: int = 3  # passes over the sweep; each scenario keeps its fastest run (others were disturbed)
    decodes: tuple[int, ...] = (0, 1, 4, 16, 32)
    contexts: tuple[int, ...] = (16, 128, 512)
    prefill_tokens: tuple[int, ...] = (0, 0, 16, 64, 256)
    prefill_starts: tuple[int, ...] = (0, 256)
    forward_tokens: tuple[int, ...] = (0, 0, 32, 128)
    backward_tokens: tuple[int, ...] = (0, 0, 32, 128)  # tokens of one layer's tasklet, times layers
    finetune_length: int = 512  # tokens of each training example

    def __post_init__(self) -> None:
        if self.iterations < 4 or self.repeats < 1:
            raise ValueError(f"iterations must be >= 4 and repeats >= 1, got {self.iterations} and "
                             f"{self.repeats}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One measured iteration's work."""

    decode_contexts: tuple[int, ...]
    prefill: tuple[int, int] | None  # (start, tokens)
    adapters: int  # inference sequences use adapters 0..adapters-1 round-robin (0: base model)
    forward_tokens: int
    backward_layers: int  # backward token-layers, as layers of a `backward_tokens`-token tasklet
    backward_tokens: int


def design(settings: SweepSettings, num_adapters: int, max_len: int) -> list[Scenario]:
    """The sweep's scenarios, deterministic for a seed; contexts and prefills fit `max_len`.

    The first `warmup` ones exercise every kind of work once (first calls pay for kernel builds and
    allocator growth) and are not measured. Every drawn iteration holds inference work (decodes or a
    prefill chunk; fine-tuning work beside it or not): see the module docstring.
    """
    rng = random.Random(settings.seed)
    short = min(settings.contexts)
    kinds = [Scenario((short,) * 4, (0, 64), num_adapters, 32, 0, 0),
             Scenario((short,), None, 0, 0, 1, 32)]
    out = [kinds[i % len(kinds)] for i in range(settings.warmup)]
    while len(out) < settings.iterations + settings.warmup:
        contexts = [c for c in settings.contexts if c < max_len]
        decodes = tuple(rng.choice(contexts) for _ in range(rng.choice(settings.decodes)))
        tokens = rng.choice(settings.prefill_tokens)
        start = rng.choice(settings.prefill_starts)
        prefill = (start, tokens) if tokens and start + tokens <= max_len else None
        backward = rng.choice(settings.backward_tokens)
        forward = rng.choice(settings.forward_tokens) if not backward else 0
        if decodes or prefill:
            out.append(Scenario(decodes, prefill, rng.randint(0, num_adapters), forward,
                                rng.randint(1, 4) if backward else 0, backward))
    return out


@dataclass
class ProfileReport:
    """The fitted model and how well it predicts iterations it was not fitted on."""

    model: LatencyModel
    heldout_mape: float
    train_mape: float
    train_samples: int
    heldout_samples: int
    skipped_optimizer_iterations: int
    samples: list[Sample] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """The JSON the CLI writes: loadable by `LatencyModel.from_dict` (extra keys are ignored)."""
        return {**self.model.to_dict(), "heldout_mape": self.heldout_mape,
                "heldout_samples": self.heldout_samples, "train_mape": self.train_mape,
                "train_samples": self.train_samples,
                "skipped_optimizer_iterations": self.skipped_optimizer_iterations}


class DesignedPlans:
    """The profiler's plan source for `EngineCore`, in place of a policy: it yields the plan the harness
    designed (an empty one when none is queued). Results change nothing here: the sweep reads times."""

    def __init__(self) -> None:
        self._step_ids = itertools.count()
        self._queued: IterationPlan | None = None

    def new(self) -> IterationPlan:
        """An empty plan with the next step id, for the harness to fill and `queue`."""
        return IterationPlan(step_id=next(self._step_ids))

    def queue(self, plan: IterationPlan) -> None:
        self._queued = plan

    def plan(self) -> IterationPlan:
        plan, self._queued = self._queued, None
        return plan if plan is not None else self.new()

    def update(self, plan: IterationPlan, result: IterationResult) -> list[Request]:
        return []

    def has_work(self) -> bool:
        return self._queued is not None


class _Harness:
    """Builds the iterations of the sweep and runs them on one engine through an `EngineCore` over
    `DesignedPlans`, the job beside them as `JobPieces` (policy-free, see module docstring)."""

    def __init__(self, engine: BuiltEngine, adapter_dirs: list[str], settings: SweepSettings) -> None:
        self.engine = engine
        layout = engine.layout
        self.kv = KVBlockManager(layout.num_kv_blocks, layout.block_size, enable_prefix_caching=False)
        self.slots = AdapterSlots(layout.num_adapter_slots)
        self.adapters = [AdapterRef(i, f"profile-{i}", path) for i, path in enumerate(adapter_dirs)]
        self.rng = random.Random(settings.seed + 1)
        self.slot_of: dict[str, int] = {}
        vocab = engine.model_config.vocab_size
        length = min(settings.finetune_length, layout.max_model_len)
        examples = [TrainingExample([self.rng.randrange(8, vocab) for _ in range(length)],
                                    [True] * length) for _ in range(4)]
        spec = FinetuneJobSpec(job_id="profile-job", tenant="profile", adapter_id=10_000,
                               examples=examples, n_epochs=10**6, batch_size=2, seed=settings.seed,
                               num_layers=engine.model_config.num_layers, output_dir="/nonexistent",
                               min_tasklet_tokens=1, lora=LoRASettings(r=8, lora_alpha=16))
        self.job = JobPieces(CoservedJob(spec, self.kv, self.slots))
        self.plans = DesignedPlans()
        self.core = EngineCore(self.plans, self.job)
        # An engine that owns its KV cache (vLLM) needs the earlier tokens computed before the measured
        # chunk: they are prefilled in unmeasured iterations, sharing one prefix (its prefix cache makes
        # that cheap) up to the last whole block before the measured position.
        self._fills = layout.engine_owns_kv_cache
        self._shared = [self.rng.randrange(8, vocab) for _ in range(layout.max_model_len)] if self._fills else []
        self._load_adapters()

    def _run(self, plan: IterationPlan, job_budget: tuple[int, int] | None = None) -> Step:
        """Run `plan`, with the job's piece of `job_budget` (forward tokens, backward token-layers)."""
        self.plans.queue(plan)
        self.job.budget = job_budget
        step = self.core.step(self.engine)
        if step.result.training.failures:
            failure = step.result.training.failures[0]
            raise RuntimeError(f"the profiling job failed: {failure.code}: {failure.message}")
        return step

    def _load_adapters(self) -> None:
        plan = self.plans.new()
        for ref in self.adapters:
            grant = self.slots.acquire(ref)  # pinned for the whole sweep
            if grant is None:
                raise ValueError("more profiling adapters than the engine's adapter slots minus one")
            if grant.load is not None:
                plan.adapter_loads.append(grant.load)
        self._run(plan)

    def _bring_job_to(self, phase: JobPhase) -> None:
        """Unmeasured iterations until the job's sequence in flight is in `phase`."""
        for _ in range(10_000):
            if self.job.job.phase is phase:
                return
            # Only the other phase's work: a backward budget would finish a completed forward's
            # backward in the same iteration and the job would never rest in its backward phase.
            if phase is JobPhase.BACKWARD:
                self._run(self.plans.new(), (SETUP_TOKENS, 0))
            else:
                self._run(self.plans.new(), (0, SETUP_TOKENS * self.engine.model_config.num_layers))
        raise RuntimeError(f"the profiling job never reached its {phase.name} phase")

    def _setup_sequences(self, scenario: Scenario) -> list[ScheduledChunk]:
        """Send the sequences with KV blocks for their earlier tokens (whose K/V are not computed:
        see the module docstring); returns the measured chunks."""
        specs = [(c, 1) for c in scenario.decode_contexts]
        if scenario.prefill is not None:
            specs.append(scenario.prefill)
        measured, setup = [], self.plans.new()
        for i, (start, count) in enumerate(specs):
            rid = f"p{setup.step_id + 1}-{i}"
            slot = self.slots.slot_of(self.adapters[i % scenario.adapters].adapter_id) \
                if scenario.adapters else -1
            self.slot_of[rid] = -1 if slot is None else slot
            shared = self._shared[:max(0, start - 1) // self.kv.block_size * self.kv.block_size]
            tokens = shared + [self.rng.randrange(8, self.engine.model_config.vocab_size)
                               for _ in range(start + count - len(shared))]
            if not self.kv.allocate_slots(rid, start + count):
                raise ValueError("the KV cache is too small for the sweep: lower the contexts")
            setup.new_sequences.append(NewSequence(rid, tokens, GREEDY, adapter_slot=self.slot_of[rid]))
            measured.append(ScheduledChunk(rid, start, count, self.kv.block_table(rid), sample=True))
        self._run(setup)
        if self._fills:
            self._fill(measured)
        return measured

    def _fill(self, measured: list[ScheduledChunk]) -> None:
        """Unmeasured iterations computing each sequence's positions before its measured chunk."""
        budget = min(SETUP_TOKENS, self.engine.config.max_batch_tokens)  # the engine's own step budget
        pending = [(c.request_id, 0, c.start, c.block_table) for c in measured if c.start > 0]
        while pending:
            plan, left, rest = self.plans.new(), budget, []
            for rid, pos, end, table in pending:
                count = min(end - pos, left)
                if count > 0:
                    plan.chunks.append(ScheduledChunk(rid, pos, count, table, sample=False))
                    left -= count
                if pos + count < end:
                    rest.append((rid, pos + count, end, table))
            self._run(plan)
            pending = rest

    def measure(self, scenario: Scenario) -> tuple[Sample, bool]:
        """Run the scenario; returns (features, seconds) and whether an optimizer step ran in it."""
        if scenario.forward_tokens:
            self._bring_job_to(JobPhase.FORWARD)
        elif scenario.backward_tokens:
            self._bring_job_to(JobPhase.BACKWARD)
        chunks = self._setup_sequences(scenario)
        plan = self.plans.new()
        plan.chunks = chunks
        step = self._run(plan, (scenario.forward_tokens, scenario.backward_tokens * scenario.backward_layers))
        features = plan_features(plan, self.slot_of)
        ids = [c.request_id for c in chunks]
        teardown = self.plans.new()
        teardown.freed = ids
        self._run(teardown)
        for rid in ids:
            self.kv.free(rid)
            del self.slot_of[rid]
        return (features, step.result.timings.total_s), bool(plan.training.optimizer_steps)


def scenario_runs(engine: BuiltEngine, adapter_dirs: list[str],
                  settings: SweepSettings) -> list[list[tuple[Sample, bool]]]:
    """Every measured run of every scenario after the warm-up: `repeats` (features, seconds) runs per
    scenario with the optimizer flag, in pass order (their spread is the machine's noise)."""
    harness = _Harness(engine, adapter_dirs, settings)
    scenarios = design(settings, len(adapter_dirs), engine.layout.max_model_len)
    for scenario in scenarios[:settings.warmup]:
        harness.measure(scenario)
    measured = scenarios[settings.warmup:]
    runs: list[list[tuple[Sample, bool]]] = [[] for _ in measured]
    # Whole passes over the sweep rather than back-to-back repeats: a burst of load from another
    # process lasts seconds, so it rarely hits the same scenario in every pass.
    for _ in range(settings.repeats):
        for i, scenario in enumerate(measured):
            runs[i].append(harness.measure(scenario))
    return runs


def iterate_samples(engine: BuiltEngine, adapter_dirs: list[str],
                    settings: SweepSettings) -> Iterator[tuple[Sample, bool]]:
    """Measured (features, seconds) of every scenario after the warm-up, its fastest run, and the
    optimizer flag."""
    for runs in scenario_runs(engine, adapter_dirs, settings):
        yield min(runs, key=lambda run: run[0][1])


def profile(engine: BuiltEngine, fingerprint: ModelFingerprint, adapter_dirs: list[str],
            settings: SweepSettings) -> ProfileReport:
    """Run the sweep, fit on a random part of it, evaluate on the rest."""
    return fit_report(list(iterate_samples(engine, adapter_dirs, settings)), fingerprint, settings)


def fit_report(runs: list[tuple[Sample, bool]], fingerprint: ModelFingerprint,
               settings: SweepSettings) -> ProfileReport:
    """Fit on a random (seeded) part of the measured iterations, evaluate on the rest; iterations with
    an optimizer step are left out (module docstring)."""
    kept = [sample for sample, had_optimizer_step in runs if not had_optimizer_step]
    skipped = len(runs) - len(kept)
    random.Random(settings.seed + 2).shuffle(kept)
    n_heldout = max(1, round(len(kept) * settings.heldout_fraction))
    heldout, train = kept[:n_heldout], kept[n_heldout:]
    if not train:
        raise ValueError("too few measured iterations to fit: raise --iterations")
    model = LatencyModel(fingerprint)
    model.fit(train)
    return ProfileReport(model, model.heldout_mape(heldout), model.heldout_mape(train), len(train),
                         len(heldout), skipped, kept)
