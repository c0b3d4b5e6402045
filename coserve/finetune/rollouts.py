"""A reinforcement job's rollout loop (GRPO), beside its `CoservedJob`. Pure Python.

For each batch, once the job's last step is in the engine (`needs_rollouts`):

1. sample `samples` completions of each of the batch's prompts from the adapter being trained: ordinary
   inference requests of the job's tenant (a fan-out per prompt), through the adapter's bank slot, the
   weights the trainer writes after every step: no copy, no disk. They queue and are admitted like any
   request of that tenant, behind no one and ahead of no one (its virtual token counter charges them).
   Their adapter's `version` is the job's step count, so the prefix cache never reuses a prompt's K/V
   computed with an earlier step's weights;
2. as each step's outputs come (`advance`), keep each completion's tokens and the log-prob the sampler
   gave each (temperature 1: the distribution the trainer differentiates);
3. when every completion of the batch is done, have them graded (`RolloutGrading`: off the caller's
   thread; the loop goes on meanwhile), compute the group-relative advantages and feed the batch to the
   job, which trains it with its policy-gradient loss; its step's event carries the rewards
   (`train_reward_mean`, ..., and each sub-grader's mean as `train_reward/<name>`).

Evaluations (`Evaluations`) sample the validation prompts with the same weights at step 0, every
`eval_interval` steps and after the last step, and report `valid_reward_mean` as a validation event.

A sample the grader cannot grade scores 0 and is reported (`notices`); a batch none of whose samples could
be graded fails the job with the grader's message (its checkpoints stay). The caller submits and aborts
requests (`submit`, `abort`), hands over each iteration's outputs, and pops `events` and `notices`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from coserve.contract.data_position import DataPosition
from coserve.contract.job_spec import JobEvent
from coserve.contract.reinforcement import GradedSample, RolloutGrading
from coserve.contract.sampling import AdapterRef, EosIds, SamplingParams
from coserve.finetune.job import CoservedJob
from coserve.finetune.rollout_batches import FedBatch, Rollout, fed_batches, group_advantages
from coserve.finetune.rollout_evaluations import Evaluations, reward_metrics
from coserve.finetune.rollout_sampling import Sampling, StepOutputs, record
from coserve.inference.request import Request, expand_request

GRADER_FAILED = "grader_failed"  # the code of a job whose grader could grade no sample of a batch


def needs_rollouts(job: CoservedJob) -> bool:
    """A running reinforcement job between steps (no batch in flight, none graded and waiting): its next
    batch is to be sampled (from `position`, after the last step's weights are in the engine)."""
    return job.runnable and job.between_batches and not fed_batches(job.source).queued \
        and job.position.epoch < job.spec.n_epochs and not job.failing


@dataclass(slots=True)
class _Batch:
    after: DataPosition
    samplings: list[Sampling]
    grading: Future[list[GradedSample]] | None = None


class RolloutDriver:
    """The rollout loop of one reinforcement job (module docstring).

    Args:
        job: the job; its spec's `rollouts` says what to sample and how to grade.
        eos: the tokenizer's end-of-sequence ids.
        grading: grades completions off this thread.
        submit: queues a request (on the job's engine).
        abort: finishes a request early by id.
        fail: fails the job, (code, message).
    """

    def __init__(self, job: CoservedJob, eos: EosIds, grading: RolloutGrading, submit: Callable[[Request], None],
                 abort: Callable[[str], object], fail: Callable[[str, str], None]) -> None:
        if job.spec.rollouts is None:
            raise ValueError(f"job {job.job_id} has no rollout spec")
        self.job, self.spec = job, job.spec.rollouts
        self._fed = fed_batches(job.source)  # where the graded batches go
        self._prompts = [list(e.token_ids) for e in job.spec.examples]
        self._eos, self._grading, self._submit, self._abort, self._fail = eos, grading, submit, abort, fail
        self._batch: _Batch | None = None
        self.evaluations = Evaluations(job, self._fed, self.spec, self._sample, grading)
        self.notices: list[str] = []  # grader errors, for the job's events

    @property
    def in_flight(self) -> tuple[int, bool] | None:
        """(the step whose rollouts are in flight, whether they are being graded); None between batches."""
        batch = self._batch
        return None if batch is None else (batch.after.step, batch.grading is not None)

    @property
    def waiting_for(self) -> str | None:
        """What the job waits for when it has no training work: its rollouts' sampling or grading."""
        batch = self._batch
        if batch is None:
            return None
        if batch.grading is not None and batch.grading.done():
            return f"the evaluation of step {batch.after.step - 1} sampling the weights step {batch.after.step} changes"
        if batch.grading is not None:
            return f"grading the {len(batch.samplings)} rollouts of step {batch.after.step}"
        done = sum(1 for s in batch.samplings if s.request.is_finished)
        return (f"sampling the rollouts of step {batch.after.step}: {done} of {len(batch.samplings)} "
                f"completions done, {sum(len(s.logprobs) for s in batch.samplings)} tokens sampled")

    def pop_events(self) -> list[JobEvent]:
        return self.evaluations.pop_events()

    def advance(self, outputs: StepOutputs | None = None) -> None:
        """Take an iteration's outputs; grade a sampled batch; feed a graded one; start the next."""
        job = self.job
        if job.state.is_finished:
            self.stop()
            return
        if outputs is not None:
            sampled = record(self._batch.samplings if self._batch else [], outputs)
            sampled += self.evaluations.record(outputs)
            job.note_progress(sampled)
        self.evaluations.advance()
        batch = self._batch
        if batch is not None and batch.grading is None and all(s.request.is_finished for s in batch.samplings):
            rows = [self.spec.items[s.prompt_index] for s in batch.samplings]
            batch.grading = self._grading.grade(job.tenant, self.spec.grader, rows,
                                                [s.completion() for s in batch.samplings])
        if batch is not None and batch.grading is not None and batch.grading.done() \
                and not self.evaluations.sampling:  # an evaluation samples the weights this batch changes
            self._batch = None
            job.note_progress(1)
            self._feed(batch, batch.grading.result())
        if self._batch is None and needs_rollouts(job):
            self.evaluations.start_due()
            self._start()
        elif self._batch is None:
            self.evaluations.start_due()  # after the last step: the final weights

    def stop(self) -> None:
        """Abort what is in flight (the job ended, or its run is over); nothing more is reported."""
        in_flight = (self._batch.samplings if self._batch else []) + self.evaluations.drop()
        for sampling in in_flight:
            if not sampling.request.is_finished:
                self._abort(sampling.request.request_id)
        self._batch = None

    def _sample(self, name: str, prompt_index: int, prompt: list[int], samples: int, seed: int) -> list[Sampling]:
        """Submit `samples` completions of `prompt` from the job's current weights."""
        job = self.job
        # The weights after `position.step` steps: a version of their own for the prefix cache.
        adapter = AdapterRef(job.spec.adapter_id, f"training:{job.job_id}", f"training:{job.job_id}",
                             version=job.position.step)
        params = SamplingParams(n=samples, temperature=1.0, top_p=1.0, max_tokens=self.spec.max_tokens,
                                logprobs=0, seed=seed)
        samplings = [Sampling(prompt_index, request) for request in
                     expand_request(f"{job.job_id}/{name}", prompt, params, self._eos, adapter, tenant=job.tenant)]
        for sampling in samplings:
            self._submit(sampling.request)
        return samplings

    def _start(self) -> None:
        job = self.job
        indices, after = job.position.next_batch(len(self._prompts), job.spec.batch_size)
        samplings = []
        for index in indices:
            seed = job.spec.seed * 1_000_003 + after.step * 10_007 + index
            samplings += self._sample(f"r{after.step}.{index}", index, self._prompts[index], self.spec.samples, seed)
        self._batch = _Batch(after, samplings)

    def _feed(self, batch: _Batch, grades: list[GradedSample]) -> None:
        errors = [g.error for g in grades if g.error is not None]
        step = batch.after.step
        if len(errors) == len(grades):
            self._fail(GRADER_FAILED, f"the grader could grade none of the {len(grades)} samples of step {step}: "
                                      f"{errors[0]}")
            return
        if errors:
            self.notices.append(f"step {step}: {len(errors)} of {len(grades)} samples could not be graded and "
                                f"scored 0: {errors[0]}")
        rollouts = []
        for s, g in zip(batch.samplings, grades, strict=True):
            completion = s.completion()
            rollouts.append(Rollout(s.prompt_index, self._prompts[s.prompt_index], completion,
                                    s.logprobs[:len(completion)], g.reward))
        group = self.spec.samples
        advantages = [a for g in range(0, len(rollouts), group)
                      for a in group_advantages([r.reward for r in rollouts[g:g + group]])]
        metrics = reward_metrics("train", grades)
        if not any(r.completion_token_ids for r in rollouts):
            self._fail("empty_rollouts", f"every completion of step {step} was empty: nothing to train")
            return
        self._fed.feed(FedBatch(batch.after, rollouts, advantages, metrics))
