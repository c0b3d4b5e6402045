"""A job's training state moved off the device while it holds no bank slot (a parked driven run,
`TrainingWork.job_parks`), and back (`JobUnpark`).

What moves: the LoRA master weights, their gradient (a run parks between its calls, possibly between a
`forward_backward` and its `optim_step`), and the AdamW moments. The tensors keep their identity (their
`.data` and `.grad` move, the optimizer's state follows its parameters), so nothing is rebuilt and the
state comes back bit for bit. What is dropped: the gradient mark of the call before (a call that parks
is done: nothing is left to roll back) and the trainer's snapshot for standalone windows (remade from
the weights when the job is installed again).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coserve.contract.training_plan import JobUnpark
from coserve.trainer.job_state import TrainingJobState

HOST = torch.device("cpu")


def move_job(job: TrainingJobState, device: torch.device) -> None:
    """Move the job's weights, gradient and optimizer moments to `device` (a no-op where they are)."""
    for param in job.lora.parameters():
        grad, param.grad = param.grad, None
        param.data = param.data.to(device)
        param.grad = None if grad is None else grad.to(device)
    for state in job.optimizer.state_tensors():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # AdamW's `step` stays where it is
                state[key] = value.to(device)


def park_job(jobs: dict[str, TrainingJobState], parked: dict[str, TrainingJobState], job_id: str,
             drop: Callable[[str], None]) -> None:
    """Move a job (with no sequence in flight) from `jobs` to `parked`, its state to host memory; `drop`
    empties its bank slot."""
    job = jobs.get(job_id)
    if job is None:
        return
    drop(job_id)
    job.mark = None
    job.trainer.drop_snapshot()
    move_job(job, HOST)
    parked[job_id] = job


def unpark_job(jobs: dict[str, TrainingJobState], parked: dict[str, TrainingJobState], unpark: JobUnpark,
               device: torch.device) -> bool:
    """Move a parked job back to `jobs`, its state to `device`, in its new slot; False when it is not parked
    (install its adapter when True)."""
    job = parked.pop(unpark.job_id, None)
    if job is None:
        return False
    move_job(job, device)
    job.slot = unpark.adapter_slot
    jobs[unpark.job_id] = job
    return True
