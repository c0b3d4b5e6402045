"""vLLM's per-tensor "Attempted to load weight ... with dtype X into parameter with dtype Y" lines, as one.

While loading a model whose checkpoint dtype differs from the dtype it runs in, vLLM 0.32.0 logs one
warning per tensor (`vllm.model_executor.models.utils` `AutoWeightsLoader`, and the sharded-state
loader): hundreds of lines for a small model. coserve hands vLLM an explicit dtype (`--dtype auto` is
the model's, `coserve.model.config.dtype_name`), so with the defaults nothing is cast on the CPU; an
operator asking for another dtype (`--dtype bfloat16` on a float32 checkpoint) still gets the casts, and
`summarized_cast_warnings` turns them into one line per (from, to) pair: how many tensors were cast.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

# The loggers that log the per-tensor line, and its format (vLLM 0.32.0).
CAST_LOGGERS = ("vllm.model_executor.models.utils", "vllm.model_executor.model_loader.sharded_state_loader")
CAST_MESSAGE = "Attempted to load weight %s with dtype %s into parameter with dtype %s"


def _dtype(value: object) -> str:
    return str(value).removeprefix("torch.")


class CastWarnings(logging.Filter):
    """Drops vLLM's per-tensor cast lines, counting them by (checkpoint dtype, parameter dtype) and the
    highest level they were logged at; passes every other record."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[str, str]] = Counter()
        self.level = logging.DEBUG

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg != CAST_MESSAGE or not isinstance(args, tuple) or len(args) != 3:
            return True
        self.casts[(_dtype(args[1]), _dtype(args[2]))] += 1
        self.level = max(self.level, record.levelno)
        return False

    def summary(self) -> list[str]:
        """One line per (from, to) pair, most casts first."""
        return [f"vLLM cast {count} weight tensor(s) from {src} to {dst} while loading the model"
                for (src, dst), count in self.casts.most_common()]


@contextmanager
def summarized_cast_warnings() -> Iterator[CastWarnings]:
    """Within the block, vLLM's per-tensor cast lines are dropped; at its end (also when it raises) one
    summary line per (from, to) pair is logged on this module's logger, at the level vLLM used."""
    cast_filter = CastWarnings()
    loggers = [logging.getLogger(name) for name in CAST_LOGGERS]
    for vllm_logger in loggers:
        vllm_logger.addFilter(cast_filter)
    try:
        yield cast_filter
    finally:
        for vllm_logger in loggers:
            vllm_logger.removeFilter(cast_filter)
        for line in cast_filter.summary():
            logger.log(cast_filter.level, line)
