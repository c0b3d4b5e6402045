"""The parts in turn under one time budget, each one's failure caught and recorded, the report rewritten
after every part.

A part is skipped when less of the budget is left than it needs (`PART_NEEDS_S`, measured on the CPU for
--quick; on a GPU, estimates until a first run measures them); a part running past the end of the
budget is interrupted (SIGALRM) and recorded as an error with what it had measured so far. An exception in
a part (CUDA out of memory, a shape the engine refuses, ...) is recorded with its traceback, the device's
memory released, and the next part runs.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from _gpu_check import (
    part_attention,
    part_coserving,
    part_gradient,
    part_parity,
    part_throughput,
    part_trainer,
)
from _gpu_check.context import Context, free_memory
from _gpu_check.record import ERROR, SKIPPED, PartRecord, write

Part = Callable[[Context, PartRecord], None]
PARTS: dict[str, Part] = {"attention": part_attention.run, "parity": part_parity.run,
                          "gradient": part_gradient.run, "throughput": part_throughput.run,
                          "trainer": part_trainer.run, "coserving": part_coserving.run}
# Seconds a part needs at least to be worth starting (GPU sizes, --quick sizes).
PART_NEEDS_S: dict[str, tuple[float, float]] = {"attention": (15, 2), "parity": (60, 5), "gradient": (30, 3),
                                                "throughput": (60, 4), "trainer": (30, 3), "coserving": (90, 12)}


class OutOfBudget(BaseException):
    """The run's time budget ended inside a part (a BaseException: no `except Exception` swallows it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `OutOfBudget` in this (main) thread after `seconds`; an alarm set before (a test runner's
    timeout) is put back afterwards with what was left of it."""
    def alarm(signum: int, frame: Any) -> None:
        raise OutOfBudget(f"the run's time budget ended after {seconds:.1f} s in this part")

    if not hasattr(signal, "setitimer"):
        yield
        return
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 0.001), old_interval)


def _run_one(ctx: Context, rec: PartRecord) -> None:
    start = time.perf_counter()
    try:
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        with time_limit(ctx.remaining_s()):
            PARTS[rec.name](ctx, rec)
        rec.finish()
    except (Exception, OutOfBudget) as exc:  # recorded; the next part runs
        rec.status, rec.error = ERROR, traceback.format_exc()
        traceback.clear_frames(exc.__traceback__)
    finally:
        rec.seconds = time.perf_counter() - start
        try:  # a sticky CUDA error fails these too: recorded, and the report is still written
            if ctx.cuda:  # the part's peak, for memory sizing
                rec.details["cuda_max_memory_allocated_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
            free_memory()
        except Exception as err:  # noqa: BLE001
            rec.details["cleanup_error"] = repr(err)


def run_parts(ctx: Context, names: list[str], meta: dict[str, Any], started: float) -> list[PartRecord]:
    """Run `names` in order; the report in `ctx.out_dir` is rewritten after each."""
    records: list[PartRecord] = []
    for name in names:
        rec = PartRecord(name)
        records.append(rec)
        need, left = PART_NEEDS_S[name][1 if ctx.quick else 0], ctx.remaining_s()
        if left < need:
            rec.status, rec.error = SKIPPED, f"{left:.0f} s of the budget left; the part needs about {need:.0f} s"
        else:
            print(f"[gpu_check] {name}: starting, {left:.0f} s of the budget left", file=sys.stderr, flush=True)
            _run_one(ctx, rec)
        print(f"[gpu_check] {name}: {rec.status} in {rec.seconds:.1f} s" + (f": {rec.summary}" if rec.summary else ""),
              file=sys.stderr, flush=True)
        if rec.error and rec.status == ERROR:
            print(rec.error, file=sys.stderr, flush=True)
        meta["total_s"] = time.monotonic() - started
        write(ctx.out_dir, meta, records)
    return records
