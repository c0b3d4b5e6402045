"""The co-serving policy's latency model at work: refined online from every measured iteration, the bias
it leaves at the operating point (`overrun`), and the warning when the TPOT SLO cannot hold at all."""

from __future__ import annotations

import logging

from coserve.contract.plan import IterationPlan, IterationResult
from coserve.planner.latency import LatencyModel, PlanFeatures
from coserve.planner.settings import CoServingConfig

logger = logging.getLogger(__name__)

# The measured/predicted ratio's moving average: weight of a new iteration, and bounds on one sample
# (a hiccup of the machine must not stop fine-tuning for long, nor a lucky run overfill iterations).
OVERRUN_SMOOTHING = 0.1
MIN_OVERRUN, MAX_OVERRUN = 0.5, 3.0


class OnlineLatency:
    """The latency model, fed with each planned iteration's features and its measured time.

    Args:
        config: the SLOs and limits (for the decode-batch check).
        model: the iteration latency model (refined online, through its `SampleGuard`).
        learn: False for a policy with no SLO (`FinetuneShare.learns_latency`): the model is kept as it
            is and no SLO is checked.
    """

    def __init__(self, config: CoServingConfig, model: LatencyModel, learn: bool = True) -> None:
        self._config = config
        self.model = model
        self._learn = learn
        self._planned: dict[int, PlanFeatures] = {}  # step id -> features, until its result
        # Measured / predicted time of iterations with fine-tuning work (moving average): what the
        # latency model's fit leaves as bias at the operating point (missing nonlinear terms, a slow
        # online fit). Iterations filled to the budget must take the SLO on average, so the budget
        # the model is asked about is divided by it.
        self.overrun = 1.0
        self.slo_warning: str | None = None  # set when the SLO cannot hold for a full decode batch
        # Decode iterations a model learned online measures before the SLO check runs again (0: never;
        # a fitted or loaded model was checked at construction).
        self._unchecked_decode_samples = 0 if model.trusted or not learn else model.guard.warmup_samples
        if learn:
            self._check_decode_batch_fits()

    def _check_decode_batch_fits(self) -> None:
        """Warn (`slo_warning`, logged) when one decode, or a full batch of them, already breaks the SLO
        by the latency model: such iterations leave fine-tuning only its minimum share. Checked at
        construction, and for a model learned online once it has measured `warmup_samples` decode
        iterations."""
        co = self._config
        for n in (1, co.scheduler.max_num_seqs):
            batch = PlanFeatures(decode_tokens=n, decode_context=n, num_sequences=n)
            predicted = self.model.predict(batch)
            if predicted > co.iteration_budget_s:
                self.slo_warning = (
                    f"tpot_slo_ms={co.tpot_slo_ms:g} (minus the safety margin {co.safety_margin:g}) "
                    f"is below the predicted {predicted * 1000:.1f} ms of an iteration of {n} decode(s) on "
                    f"this machine (max_num_seqs={co.scheduler.max_num_seqs}): such iterations miss "
                    f"the SLO and fine-tuning gets only its minimum share; raise --tpot-slo-ms"
                    + (" or lower --max-num-seqs" if n > 1 else ""))
                logger.warning("coserve: %s", self.slo_warning)
                return

    def planned(self, step_id: int, features: PlanFeatures) -> None:
        """Remember what the plan `step_id` holds until its result comes."""
        if self._learn:
            self._planned[step_id] = features

    def observe(self, plan: IterationPlan, result: IterationResult) -> None:
        """Learn from the plan's measured time (plans of another policy's, or unmeasured, are skipped)."""
        features = self._planned.pop(plan.step_id, None)
        if features is None or result.timings.total_s <= 0:
            return
        if plan.training.forward_windows or plan.training.backward_tasklets:
            predicted = self.model.predict(features)
            if predicted > 0:
                ratio = min(max(result.timings.total_s / predicted, MIN_OVERRUN), MAX_OVERRUN)
                self.overrun += OVERRUN_SMOOTHING * (ratio - self.overrun)
        self.model.observe(features, result.timings.total_s)
        if features.decode_tokens and self._unchecked_decode_samples > 0:
            # A model learned online can say what a decode costs once it has measured some (an
            # idle engine's fine-tuning iterations alone cannot separate it from the constant).
            self._unchecked_decode_samples -= 1
            if not self._unchecked_decode_samples and self.model.trusted:
                self._check_decode_batch_fits()
