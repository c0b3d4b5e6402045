"""JobPieces: a job beside an FCFS policy, driven through EngineCore with the piece its driver sets."""

from __future__ import annotations

from coserve.cluster.engine_core import EngineCore
from coserve.contract.job_spec import FinetuneJobSpec, JobState
from coserve.contract.plan import IterationPlan, IterationResult
from coserve.contract.training_plan import TrainingExample
from coserve.finetune.job import CoservedJob
from coserve.finetune.pieces import JobPieces
from coserve.inference.adapter_slots import AdapterSlots
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.planner import InferencePlanner
from coserve.inference.scheduler_config import SchedulerConfig
from coserving_sim import execute


class Executor:
    def step(self, plan: IterationPlan) -> IterationResult:
        return execute(plan)


def setup() -> tuple[InferencePlanner, JobPieces, EngineCore]:
    policy = InferencePlanner(SchedulerConfig(max_model_len=256, block_size=4), KVBlockManager(64, 4, True),
                        AdapterSlots(2))
    examples = [TrainingExample(list(range(1, 41)), [False] + [True] * 39)]
    spec = FinetuneJobSpec(job_id="j", tenant="t", adapter_id=100, examples=examples, n_epochs=100,
                           batch_size=1, seed=0, num_layers=4, output_dir="/out/j", min_tasklet_tokens=1)
    pieces = JobPieces(CoservedJob(spec, policy.kv, policy.adapters))
    return policy, pieces, EngineCore(policy, pieces)


def test_each_step_gets_the_piece_its_driver_set() -> None:
    _, pieces, core = setup()
    assert core.step(Executor()).plan.training.is_empty  # no budget: no piece
    pieces.budget = (8, 0)
    work = core.step(Executor()).plan.training
    assert sum(w.num_tokens for w in work.forward_windows) == 8 and not work.backward_tasklets
    pieces.budget = None
    assert not core.step(Executor()).plan.training.forward_windows
    assert pieces.job.trained_tokens == 0 and pieces.job.state is JobState.RUNNING


def test_cancel_stops_the_job_in_the_next_plan_only_and_frees_its_blocks() -> None:
    policy, pieces, core = setup()
    pieces.budget = (16, 0)
    core.step(Executor())
    assert policy.kv.num_free_blocks < policy.kv.num_blocks  # the sequence in flight holds blocks
    pieces.cancel()
    assert core.step(Executor()).plan.training.job_stops == ["j"]
    assert core.step(Executor()).plan.training.is_empty
    assert pieces.job.state is JobState.CANCELLED and policy.kv.num_free_blocks == policy.kv.num_blocks
