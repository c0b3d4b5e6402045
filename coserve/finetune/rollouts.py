"""A reinforcement job's rollout loop (GRPO), beside its `FinetuneJob`. Pure Python.

For each batch, once the job's last step is in the engine (`FinetuneJob.needs_rollouts`):

1. sample `samples` completions of each of the batch's prompts from the adapter being trained: ordinary
   inference requests of the job's tenant (a fan-out per prompt), through the adapter's bank slot, the
   weights the trainer writes after every step: no copy, no disk. They queue and are admitted like any
   request of that tenant, behind no one and ahead of no one (its virtual token counter charges them).
   Their adapter's `version` is the job's step count, so the prefix cache never reuses a prompt's K/V
   computed with an earlier step's weights;
2. as each step's outputs come (`advance`), keep each completion's tokens and the log-prob the sampler
   gave each (temperature 1: the distribution the trainer differentiates);
3. when every completion of the batch is done, grade them (`grade`: prompt index and completion -> a
   reward), compute the group-relative advantages and feed the batch to the job, which trains it with
   its policy-gradient loss; its step's event carries the rewards (`train_reward_mean`, ...).

The caller submits and aborts requests (`submit`, `abort`) and hands over each iteration's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coserve.contract.data_position import DataPosition
from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import AdapterRef, EosIds, SamplingParams
from coserve.finetune.job import FinetuneJob
from coserve.finetune.rollout_batches import FedBatch, Rollout, group_advantages
from coserve.inference.request import Request, expand_request

Grade = Callable[[int, list[int]], float]  # (prompt index, completion token ids) -> reward


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    samples: int  # completions per prompt: GRPO's group
    max_tokens: int  # per completion

    def __post_init__(self) -> None:
        if self.samples < 2 or self.max_tokens < 1:
            raise ValueError(f"a group needs >= 2 samples and a completion >= 1 token, got {self.samples} "
                             f"and {self.max_tokens}")


class StepOutputs(Protocol):
    """What one iteration sampled (`cluster.engine_core.EngineStep`)."""

    @property
    def advanced(self) -> Sequence[Request]: ...

    def logprobs(self) -> Mapping[str, TokenLogprobs | None]: ...


@dataclass(slots=True)
class _Sampling:
    prompt_index: int
    request: Request
    logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    after: DataPosition
    samplings: list[_Sampling]


class RolloutDriver:
    """The rollout loop of one reinforcement job (module docstring)."""

    def __init__(self, job: FinetuneJob, prompts: Sequence[Sequence[int]], settings: RolloutSettings,
                 grade: Grade, eos: EosIds, submit: Callable[[Request], None],
                 abort: Callable[[str], object]) -> None:
        if len(prompts) != len(job.spec.examples):
            raise ValueError("one prompt per example of the job")
        self.job, self.settings = job, settings
        self._prompts = [list(p) for p in prompts]
        self._grade, self._eos, self._submit, self._abort = grade, eos, submit, abort
        self._batch: _Batch | None = None
        self.rewards: list[float] = []  # every graded rollout's reward, in order

    @property
    def sampling(self) -> bool:
        """Whether a batch's rollouts are in flight."""
        return self._batch is not None

    def advance(self, outputs: StepOutputs | None = None) -> None:
        """Take an iteration's outputs; feed a batch whose rollouts are all done; start the next one."""
        batch = self._batch
        if batch is not None and self.job.state.is_finished:
            for sampling in batch.samplings:
                if not sampling.request.is_finished:
                    self._abort(sampling.request.request_id)
            self._batch = batch = None
        if batch is not None and outputs is not None:
            self._record(batch, outputs)
        if batch is not None and all(s.request.is_finished for s in batch.samplings):
            self.job.feed(self._graded(batch))
            self._batch = None
        if self._batch is None and self.job.needs_rollouts:
            self._start()

    def _record(self, batch: _Batch, outputs: StepOutputs) -> None:
        ours = {s.request.request_id: s for s in batch.samplings}
        logprobs = outputs.logprobs()
        for request in outputs.advanced:
            sampling = ours.get(request.request_id)
            if sampling is not None:
                lp = logprobs.get(request.request_id)
                if lp is None:
                    raise RuntimeError(f"rollout {request.request_id}: the engine returned no log-prob")
                sampling.logprobs.append(lp.logprob)

    def _start(self) -> None:
        job, settings = self.job, self.settings
        indices, after = job.position.next_batch(len(self._prompts), job.spec.batch_size)
        # The weights after `position.step` steps: a version of their own for the prefix cache.
        adapter = AdapterRef(job.spec.adapter_id, f"training:{job.job_id}", f"training:{job.job_id}",
                             version=job.position.step)
        samplings = []
        for index in indices:
            params = SamplingParams(n=settings.samples, temperature=1.0, top_p=1.0, max_tokens=settings.max_tokens,
                                    logprobs=0, seed=job.spec.seed * 1_000_003 + after.step * 10_007 + index)
            for request in expand_request(f"{job.job_id}/r{after.step}.{index}", self._prompts[index], params,
                                          self._eos, adapter, tenant=job.tenant):
                samplings.append(_Sampling(index, request))
        self._batch = _Batch(after, samplings)
        for sampling in samplings:
            self._submit(sampling.request)

    def _graded(self, batch: _Batch) -> FedBatch:
        rollouts = []
        for s in batch.samplings:
            completion = list(s.request.output_token_ids)[:len(s.logprobs)]
            reward = self._grade(s.prompt_index, completion)
            rollouts.append(Rollout(s.prompt_index, self._prompts[s.prompt_index], completion,
                                    s.logprobs[:len(completion)], reward))
        group = self.settings.samples
        advantages = [a for g in range(0, len(rollouts), group)
                      for a in group_advantages([r.reward for r in rollouts[g:g + group]])]
        rewards = [r.reward for r in rollouts]
        self.rewards.extend(rewards)
        metrics = {"train_reward_mean": sum(rewards) / len(rewards),
                   "train_reward_max": max(rewards), "train_reward_min": min(rewards)}
        return FedBatch(batch.after, rollouts, advantages, metrics)
