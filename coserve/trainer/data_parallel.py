"""Data-parallel training over torch.distributed: `train_batch`'s `GradientSync` for a dedicated run.

Each process (a Ray Train worker) holds the whole base model and the same trainable adapter. A batch's
sequences are dealt round-robin over the ranks; each rank runs the windowed trainer on its share with
the whole batch's loss normaliser, so the sum of the ranks' gradients is the batch gradient one process
would accumulate. One all-reduce (sum) per step carries every gradient, flattened into one buffer as
DDP's bucketed all-reduce does, and every rank then takes the same clipped AdamW step.

Why not `torch.nn.parallel.DistributedDataParallel` itself: DDP wraps an `nn.Module` and all-reduces
once per backward pass, while the windowed trainer runs one backward per layer tasklet of every
sequence (its exact recompute), and its gradients are sums over the batch, not means over the ranks.
The arithmetic DDP would do (an all-reduce of the gradients before the optimizer step) is done here
directly, on the process group Ray Train's `TorchTrainer` sets up (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from coserve.trainer.optimizer import TrainingSequence
from coserve.trainer.windowed import WindowedTrainer

T = TypeVar("T")


class ProcessGroupSync:
    """`GradientSync` over the default process group.

    Args:
        rank, world_size: this process's rank and the number of processes.
        device: where the gradients live (NCCL reduces CUDA tensors, gloo CPU ones).
    """

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.rank, self.world_size, self.device = rank, world_size, device

    def shard(self, batch: list[T]) -> list[T]:
        """This rank's sequences: every `world_size`-th one from its rank (a rank may get none)."""
        return batch[self.rank::self.world_size]

    def all_reduce(self, params: list[torch.Tensor], loss_sum: float) -> float:
        """Sum the ranks' gradients into `params` (one flat buffer) and return the summed loss.

        A parameter keeps a None gradient only when no rank has one, as in one process (AdamW skips
        such a parameter, but would decay its moments on a zero gradient).
        """
        flat = torch.cat([torch.zeros(p.numel(), device=self.device) if p.grad is None
                          else p.grad.detach().reshape(-1).float() for p in params])
        present = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], device=self.device)
        dist.all_reduce(flat)
        dist.all_reduce(present)
        offset = 0
        for param, has in zip(params, present.tolist()):
            piece = flat[offset:offset + param.numel()].view_as(param)
            param.grad = piece.to(param.dtype).clone() if has > 0 else None
            offset += param.numel()
        return self.sum(loss_sum)

    def sum(self, value: float) -> float:
        """`value` summed over the ranks (float64)."""
        return self.sums([value])[0]

    def sums(self, values: list[float]) -> list[float]:
        """Each of `values` summed over the ranks (float64, one all-reduce)."""
        if not values:
            return []
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return [float(v) for v in total.tolist()]

    def broadcast(self, value: int) -> int:
        """Rank 0's `value` on every rank (a command agreed by all ranks at a step boundary)."""
        item = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(item, src=0)
        return int(item.item())


@torch.no_grad()
def evaluation_loss(trainer: WindowedTrainer, sequences: list[TrainingSequence],
                    sync: ProcessGroupSync | None = None) -> tuple[float, int]:
    """The summed token loss and the trained tokens of `sequences` (forward only; this rank's share
    with `sync`, then summed over the ranks): the validation loss is their ratio."""
    loss_sum, tokens = 0.0, 0
    for seq in sequences if sync is None else sync.shard(sequences):
        if seq.num_trained == 0:
            continue
        state = trainer.start_sequence(seq.token_ids, seq.trained)
        result = trainer.forward_window(state, state.length)
        loss_sum, tokens = loss_sum + result.loss_sum, tokens + result.num_tokens
    if sync is not None:
        loss_sum, tokens = sync.sum(loss_sum), int(round(sync.sum(float(tokens))))
    return loss_sum, tokens
