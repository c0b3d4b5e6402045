"""The iteration constants the SLO forces on any policy, and the bound that charges them.

`headroom`'s bound charges inference only its marginal work. But a request's output tokens are sampled
one per iteration, and a policy that keeps the SLO gives request r its n_r tokens inside

    [arrival_r, arrival_r + TTFT_SLO + (n_r - 1) * TPOT_SLO]

(the first token within the TTFT SLO, the rest at a mean gap within the TPOT SLO). Requests whose such
intervals do not overlap cannot share an iteration, so any set of pairwise disjoint intervals needs at
least the sum of their tokens in iterations; the largest such sum is a weighted interval scheduling
problem, solved exactly by `heaviest_disjoint` (only intervals wholly inside the window count, so the
iterations are in it). Each iteration pays the per-iteration constant c (the fitted model's), so any
policy keeping the SLO spends at least

    W >= I + N_forced * c + T * a

where I is inference's marginal work (`headroom`), T the trained tokens and a fine-tuning's own time per
trained token without iteration constants, taken from fine-tuning alone (its window less its iterations'
constants, per trained token: the same premise as `headroom`, that no policy trains a token with less
of its own work than fine-tuning alone does). So

    slo_bound = r * (1 - I/W - N_forced * c / W) / (1 - N_solo * c / W_solo)

with r fine-tuning alone's rate and N_solo its iterations; the benchmark reports the lower of this and
`headroom`'s bound (with few forced iterations this one would give fine-tuning its constants free). The
lower bound on iterations is loose where requests overlap (they might not all share iterations); it is
exact for a lone request, so the bound stays an upper bound on what any schedule keeping the SLO for
every request trains, within the latency model's error.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from coserve.bench.replay import RequestRecord, RunRecord
from coserve.bench.run_metrics import SLO


@dataclass(frozen=True, slots=True)
class ForcedConstants:
    """What the SLO forces in one run's window, and fine-tuning alone's constants to compare with."""

    iterations: int  # iterations any SLO-keeping policy runs in the window (a lower bound)
    constant_s: float  # the latency model's per-iteration constant
    window_s: float
    solo_constant_share: float  # fine-tuning alone: its iterations' constants, share of its window

    @property
    def share(self) -> float:
        """The forced iterations' constants, share of the window."""
        return self.iterations * self.constant_s / self.window_s


def feasible_interval(request: RequestRecord, slo: SLO) -> tuple[float, float, int] | None:
    """(earliest, latest, tokens): where an SLO-keeping policy samples the request's output tokens;
    None for a request that produced none or did not finish (its token count is not known)."""
    tokens = len(request.token_times)
    if not request.finished or tokens == 0:
        return None
    return request.arrival_s, request.arrival_s + slo.ttft_s + (tokens - 1) * slo.tpot_s, tokens


def heaviest_disjoint(windows: Iterable[tuple[float, float, int]]) -> int:
    """The heaviest total weight of pairwise disjoint (start, end, weight) windows (weighted interval
    scheduling, by end time); windows that only touch overlap (one iteration may serve both)."""
    ordered = sorted(windows, key=lambda w: w[1])
    ends = [end for _, end, _ in ordered]
    best = [0]  # best[j]: the heaviest among the first j windows
    for j, (start, _, weight) in enumerate(ordered):
        before = bisect.bisect_left(ends, start, 0, j)  # windows ending strictly before this one starts
        best.append(max(best[j], best[before] + weight))
    return best[-1]


def forced_iterations(requests: Iterable[RequestRecord], slo: SLO, window_s: float) -> int:
    """The most tokens of requests with pairwise disjoint feasible intervals inside [0, window_s]:
    iterations no SLO-keeping schedule avoids."""
    return heaviest_disjoint(iv for iv in (feasible_interval(r, slo) for r in requests)
                             if iv is not None and iv[1] <= window_s)


def forced_constants(record: RunRecord, solo: RunRecord, slo: SLO, constant_s: float) -> ForcedConstants:
    """The forced iterations of `record`'s requests, and `solo`'s (fine-tuning alone) constants."""
    solo_iterations = sum(it.inside(solo.window_s) for it in solo.iterations if it.has_work)
    return ForcedConstants(forced_iterations(record.requests, slo, record.window_s), constant_s,
                           record.window_s, solo_iterations * constant_s / solo.window_s)


def slo_bound_tokens_per_s(finetune_only_tokens_per_s: float, inference_marginal_share: float,
                           forced: ForcedConstants) -> float:
    """Fine-tuning alone's rate over what is left after inference's marginal work and the forced
    constants, at fine-tuning's own cost per token without constants (module docstring)."""
    left = max(0.0, 1.0 - inference_marginal_share - forced.share)
    return finetune_only_tokens_per_s * left / (1.0 - forced.solo_constant_share)
