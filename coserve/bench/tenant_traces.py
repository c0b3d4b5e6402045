"""A many-tenant workload for cluster projections: heavy-tailed tenants, diurnal and bursty arrivals,
adapters, shared system prompts, and a mix of fine-tuning jobs arriving over time.

Deterministic from a seed (numpy's PCG64), like `traces`.

Tenants (`zipf_shares`)
    Tenant sizes in multi-tenant services are heavy-tailed: a few tenants send most of the traffic.
    Tenant k (0-based, by size) gets a share proportional to ``1 / (k + 1) ** s`` (Zipf); with s = 1.1
    and 1000 tenants the largest sends ~18% of the requests, the top 10 ~48%, the top 100 ~77%.

Arrivals (`diurnal_arrivals`)
    The BurstGPT-shaped on/off process of `traces.bursty_arrivals`, thinned by a daily cycle compressed
    into the run: the rate is multiplied by ``1 + amplitude * sin(2 pi t / period_s)`` (a day of load
    swings within minutes of simulated time), so the mean stays `rate` over whole periods.

Requests (`tenant_trace`)
    Lengths as `traces.make_trace` (ShareGPT-shaped). A fraction of the tenants serve through an adapter
    of their own (their fine-tuned model), and every tenant's requests start with its system prompt of
    `prefix_len` tokens with probability `prefix_prob` (what a prefix cache reuses and prefix affinity
    routes by).

Jobs (`job_mix`)
    Fine-tuning jobs submitted over the run by tenants drawn with the same shares: mostly small (64
    examples of 256-1024 tokens), some large (256 examples of 1024-4096 tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coserve.bench.cluster_sim import JobArrival
from coserve.bench.traces import (
    LengthDistribution,
    RequestSpec,
    bursty_arrivals,
    sharegpt_lengths,
    synthetic_training_examples,
)
from coserve.contract.job_spec import FinetuneJobSpec


def zipf_shares(num_tenants: int, s: float = 1.1) -> np.ndarray:
    """Request shares of `num_tenants` tenants, largest first: ``(k + 1) ** -s``, normalized."""
    if num_tenants < 1 or not s >= 0:
        raise ValueError(f"need num_tenants >= 1 and s >= 0, got {num_tenants}, {s}")
    raw = 1.0 / np.arange(1, num_tenants + 1) ** s
    shares: np.ndarray = raw / raw.sum()
    return shares


def diurnal_arrivals(rate: float, duration_s: float, seed: int, *, period_s: float = 120.0,
                     amplitude: float = 0.5, peak_factor: float = 3.0) -> np.ndarray:
    """Arrival times in [0, duration_s): bursty on/off arrivals thinned by a sine cycle (module docstring).

    Raises:
        ValueError: amplitude outside [0, 1), or bad rate, duration or burst settings.
    """
    if not 0 <= amplitude < 1 or not period_s > 0:
        raise ValueError(f"need 0 <= amplitude < 1 and period_s > 0, got {amplitude}, {period_s}")
    peak = rate * (1 + amplitude)
    times = bursty_arrivals(peak, duration_s, seed, peak_factor=peak_factor)
    rng = np.random.default_rng(seed + 17)
    keep = rng.random(len(times)) < (1 + amplitude * np.sin(2 * math.pi * times / period_s)) / (1 + amplitude)
    return times[keep]


@dataclass(frozen=True, slots=True)
class TenantMix:
    """How the tenants of `tenant_trace` behave."""

    num_tenants: int = 1000
    zipf_s: float = 1.1
    adapter_fraction: float = 0.2  # tenants serving through an adapter of their own
    prefix_len: int = 64  # each tenant's system prompt, in tokens
    prefix_prob: float = 0.7  # share of a tenant's requests that start with it


def tenant_names(mix: TenantMix) -> list[str]:
    return [f"tenant-{k}" for k in range(mix.num_tenants)]


def tenant_trace(arrivals: np.ndarray, seed: int, mix: TenantMix = TenantMix(),
                 lengths: tuple[LengthDistribution, LengthDistribution] | None = None) -> list[RequestSpec]:
    """Requests at `arrivals` from `mix`'s tenants (module docstring)."""
    prompt_dist, output_dist = lengths or sharegpt_lengths()
    rng = np.random.default_rng(seed + 2_000_003)
    n = len(arrivals)
    names = tenant_names(mix)
    owners = rng.choice(mix.num_tenants, size=n, p=zipf_shares(mix.num_tenants, mix.zipf_s))
    with_adapter = rng.random(mix.num_tenants) < mix.adapter_fraction
    prompts, outputs = prompt_dist.sample(rng, n), output_dist.sample(rng, n)
    shared = rng.random(n) < mix.prefix_prob
    specs = []
    for i in range(n):
        k = int(owners[i])
        prefix = mix.prefix_len if shared[i] else 0
        specs.append(RequestSpec(f"r{i}", float(arrivals[i]), int(prompts[i]) + prefix, int(outputs[i]),
                                 names[k], adapter=f"lora-{k}" if with_adapter[k] else None,
                                 prefix_group=names[k] if prefix else None, prefix_len=prefix))
    return specs


@dataclass(frozen=True, slots=True)
class JobSize:
    """One kind of job of the mix."""

    weight: float  # its share of the jobs
    num_examples: int
    min_tokens: int
    max_tokens: int
    n_epochs: int = 1000  # trains through any run


SMALL_JOB = JobSize(0.75, 64, 256, 1024)
LARGE_JOB = JobSize(0.25, 256, 1024, 4096)


def job_mix(count: int, duration_s: float, seed: int, *, num_layers: int, vocab_size: int,
            mix: TenantMix = TenantMix(), sizes: Sequence[JobSize] = (SMALL_JOB, LARGE_JOB),
            max_window_tokens: int = 1024) -> list[JobArrival]:
    """`count` jobs submitted uniformly over the first half of the run (module docstring)."""
    rng = np.random.default_rng(seed + 3_000_017)
    names = tenant_names(mix)
    shares = zipf_shares(mix.num_tenants, mix.zipf_s)
    weights = np.array([size.weight for size in sizes])
    jobs = []
    for j in range(count):
        size = sizes[int(rng.choice(len(sizes), p=weights / weights.sum()))]
        tenant = names[int(rng.choice(mix.num_tenants, p=shares))]
        examples = synthetic_training_examples(size.num_examples, seed=seed + j, vocab_size=vocab_size,
                                               min_tokens=size.min_tokens, max_tokens=size.max_tokens)
        spec = FinetuneJobSpec(job_id=f"job-{j}", tenant=tenant, adapter_id=2**41 + j, examples=examples,
                               n_epochs=size.n_epochs, batch_size=1, seed=seed + j, num_layers=num_layers,
                               output_dir=f"/sim/job-{j}", max_window_tokens=max_window_tokens)
        jobs.append(JobArrival(float(rng.uniform(0.0, duration_s / 2)), spec))
    return jobs
