"""The scheduler actor's fine-tuning side, opened with the first engine whose policy runs jobs: the job
manager over the data dir's store (`coserve.jobs`), reinforcement jobs' rollouts graded on the scheduler's
grading threads with its own model judges (`coserve.graders.rollout_grading`, `rollout_judges`), and the
Tinker API's training runs (`TrainingService`). The engine's tokenizer, rebuilt torch-free, reads training
files, decodes rollouts and renders judges' prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from coserve.actors.scheduler_settings import SchedulerSettings
from coserve.actors.training_service import TrainingService
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.training_runs import TrainingRuns
from coserve.contract.engine import TokenizerSpec
from coserve.contract.messages import Admission, TokenBatch, TokenSubmission
from coserve.contract.sampling import EosIds
from coserve.frontend.chat_template import encode_chat
from coserve.frontend.tokenizer import Tokenizer
from coserve.graders.fair_pool import FairPool
from coserve.graders.rollout_grading import scheduler_grader
from coserve.graders.rollout_judges import RolloutJudges
from coserve.jobs.manager import JobManager, open_job_manager
from coserve.jobs.preparation import FineTuningSettings
from coserve.model.config import ModelConfig


@dataclass(slots=True)
class SchedulerLoop:
    """What the fine-tuning side needs of the scheduler actor: its own submit and stream (a model
    grader's judge is a request of the job's tenant), its event loop once it runs, a wake-up from another
    thread (a graded batch), and the trained tokens' counter (metrics)."""

    submit: Callable[[TokenSubmission], Awaitable[Admission]]
    stream: Callable[[str], AsyncIterator[TokenBatch]]
    loop: Callable[[], asyncio.AbstractEventLoop | None]
    wake: Callable[[], None]
    count_trained: Callable[[str, int, str], None]
    notify: Callable[[], None]  # new work for the engine loops (a Tinker call queued)


@dataclass(slots=True)
class FineTuningSide:
    jobs: JobManager
    runs: TrainingService


def open_fine_tuning(settings: SchedulerSettings, cluster: EngineCluster, tokenizer_spec: TokenizerSpec,
                     max_model_len: int, model: ModelConfig, actor: SchedulerLoop,
                     grading_pool: FairPool) -> FineTuningSide:
    """The job manager, rollout grading and training runs of a scheduler with a data dir (`model`: the
    base model's config)."""
    assert settings.data_dir is not None
    num_layers = model.num_layers
    data_dir = Path(settings.data_dir)
    tokenizer = Tokenizer.from_spec(tokenizer_spec)
    jobs = open_job_manager(FineTuningSettings(
        base_model_id=settings.base_model_id, base_model_path=settings.model, data_dir=data_dir,
        num_layers=num_layers, max_model_len=max_model_len, dedicated=settings.dedicated,
        python_graders=settings.enable_python_graders), cluster.jobs, tokenizer, settings.tenant_limits,
        actor.count_trained)
    eos = EosIds.resolve(tokenizer, model.eos_token_ids)

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    judges = RolloutJudges(actor.submit, actor.stream, lambda messages: encode_chat(tokenizer, messages)[1], decode,
                           eos, jobs.adapter_of, actor.loop)
    cluster.jobs.serve_rollouts(scheduler_grader(decode, settings.enable_python_graders, actor.wake, judges.judge,
                                                 grading_pool), eos)
    runs = TrainingRuns(cluster.jobs, (settings.base_model_id, settings.model), data_dir / "runs", num_layers)
    return FineTuningSide(jobs, TrainingService(runs, jobs.store, settings.tenant_limits, actor.notify))
