"""VirtualTokenCounter: FlexLLM Algorithm 4's bounds as hypothesis properties, plus the lift branches.

The properties run a small simulated server: every step serves one unit of work (a prompt of at most
L_input tokens, or at most M output or fine-tuning tokens) from the tenant `select` picks, and
charges it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.tenancy.vtc import VirtualTokenCounter, VTCWeights, backward_tasklet_tokens

token_weight = st.floats(min_value=0.25, max_value=4.0, allow_nan=False)
vtc_weights = st.builds(VTCWeights, w_p=token_weight, w_q=token_weight, w_r=token_weight)


@dataclass
class Server:
    """A backlogged server: serves one unit of work per step from the least-counter tenant."""

    vtc: VirtualTokenCounter
    max_input_len: int
    max_tokens: int
    rng: random.Random
    service: dict[str, float] = field(default_factory=dict)  # weighted tokens, not divided by share

    @property
    def bound(self) -> float:
        return self.vtc.weights.fairness_bound(self.max_input_len, self.max_tokens)

    def step(self) -> str | None:
        tenant = self.vtc.select()
        if tenant is None:
            return None
        kind = self.rng.randrange(3)
        weights = self.vtc.weights
        if kind == 0:
            n = self.rng.randint(1, self.max_input_len)
            self.vtc.charge_input(tenant, n)
            cost = weights.w_p * n
        elif kind == 1:
            n = self.rng.randint(1, self.max_tokens)
            self.vtc.charge_output(tenant, n)
            cost = weights.w_q * n
        else:
            n = self.rng.randint(1, self.max_tokens)
            self.vtc.charge_finetune(tenant, n)
            cost = weights.w_r * n
        self.service[tenant] = self.service.get(tenant, 0.0) + cost
        return tenant


def make_server(weights: VTCWeights, shares: dict[str, float], max_input_len: int, max_tokens: int,
                seed: int) -> Server:
    vtc = VirtualTokenCounter(weights, shares)
    return Server(vtc, max_input_len, max_tokens, random.Random(seed))


def spread(vtc: VirtualTokenCounter) -> float:
    counters = [vtc.counter(t) for t in vtc.backlogged]
    return max(counters) - min(counters) if counters else 0.0


# ---------------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(weights=vtc_weights, num_tenants=st.integers(2, 5), max_input_len=st.integers(1, 256),
       max_tokens=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_backlogged_tenants_stay_within_theorem_1_bound(weights: VTCWeights, num_tenants: int,
                                                        max_input_len: int, max_tokens: int,
                                                        seed: int) -> None:
    names = [f"t{i}" for i in range(num_tenants)]
    server = make_server(weights, {n: 1.0 for n in names}, max_input_len, max_tokens, seed)
    for name in names:
        server.vtc.on_backlogged(name)
    bound = server.bound
    # With no lift while backlogged, W_f(t1, t2) - W_g(t1, t2) = d(t2) - d(t1) for d = c_f - c_g, so
    # the worst interval is max(d) - min(d): tracking both checks Theorem 1 over every interval.
    lo = {(f, g): 0.0 for f in names for g in names if f < g}
    hi = dict(lo)
    for _ in range(600):
        server.step()
        assert spread(server.vtc) <= bound + 1e-9  # Lemma 1, at every step
        for f, g in lo:
            d = server.vtc.counter(f) - server.vtc.counter(g)
            lo[f, g], hi[f, g] = min(lo[f, g], d), max(hi[f, g], d)
            assert hi[f, g] - lo[f, g] <= 2 * bound + 1e-9  # Theorem 1


@settings(max_examples=20, deadline=None)
@given(weights=vtc_weights, max_input_len=st.integers(1, 64), max_tokens=st.integers(1, 64),
       seed=st.integers(0, 2**32 - 1))
def test_weights_1_2_3_give_service_1_2_3(weights: VTCWeights, max_input_len: int, max_tokens: int,
                                          seed: int) -> None:
    shares = {"a": 1.0, "b": 2.0, "c": 3.0}
    server = make_server(weights, shares, max_input_len, max_tokens, seed)
    for name in shares:
        server.vtc.on_backlogged(name)
    for _ in range(4000):
        server.step()
    total = sum(server.service.values())
    for name, share in shares.items():
        expected = share / 6.0
        # VTC's bound: a backlogged tenant's service lags its share by at most a few requests' worth of
        # tokens (max_input_len + max_tokens, weighted), which over 4000 steps is well under 5%
        assert server.service[name] / total == pytest.approx(expected, rel=0.05)


@st.composite
def churn(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Events: ('serve', 0) or ('arrive'|'leave', tenant index)."""
    events = st.one_of(
        st.tuples(st.just("serve"), st.just(0)),
        st.tuples(st.sampled_from(["arrive", "leave"]), st.integers(0, 3)),
    )
    return draw(st.lists(events, min_size=1, max_size=300))


def required_floor(vtc: VirtualTokenCounter, tenant: str) -> float:
    """What Algorithm 4 lines 7-11 require of a rejoining tenant's counter, computed independently."""
    others = [vtc.counter(t) for t in vtc.backlogged if t != tenant]
    if others:
        return min(others)
    if vtc.last_left is not None:
        return vtc.counter(vtc.last_left)
    return -math.inf


@settings(max_examples=60, deadline=None)
@given(weights=vtc_weights, events=churn(), seed=st.integers(0, 2**32 - 1),
       shares=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4))
def test_returning_tenant_gets_no_credit_beyond_the_lift(weights: VTCWeights,
                                                         events: list[tuple[str, int]], seed: int,
                                                         shares: list[float]) -> None:
    names = [f"t{i}" for i in range(4)]
    server = make_server(weights, dict(zip(names, shares)), 32, 16, seed)
    vtc = server.vtc
    # A tenant's counter moves by at most one charge / its share per step.
    bound = server.bound / min(shares)
    returned: dict[str, float] = {}  # returning tenant -> its counter right after the lift
    for action, index in events:
        name = names[index]
        if action == "arrive":
            floor, before = required_floor(vtc, name), vtc.counter(name)
            others = bool(vtc.backlogged - {name})
            if vtc.on_backlogged(name):
                assert vtc.counter(name) == max(before, floor)  # lifted exactly, never more or less
                # Track the return while the set of backlogged tenants stays as it is now; alone,
                # the returner rightly gets everything (work conservation).
                returned = {name: vtc.counter(name)} if others else {}
        elif action == "leave":
            if vtc.on_idle(name):
                returned = {}
        else:
            served = server.step()
            for other in [t for t in returned if t != served]:
                del returned[other]  # someone else was served: that return is over
            if served in returned:
                # Before anyone else is served again, the returner gains at most one bound.
                assert vtc.counter(served) - returned[served] <= bound + 1e-9
        assert spread(vtc) <= bound + 1e-9


@settings(max_examples=60, deadline=None)
@given(events=churn(), subset=st.sets(st.integers(0, 3)))
def test_select_is_work_conserving(events: list[tuple[str, int]], subset: set[int]) -> None:
    names = [f"t{i}" for i in range(4)]
    server = make_server(VTCWeights(), {n: 1.0 for n in names}, 8, 8, 0)
    vtc = server.vtc
    for action, index in events:
        if action == "arrive":
            vtc.on_backlogged(names[index])
        elif action == "leave":
            vtc.on_idle(names[index])
        chosen = vtc.select()
        assert (chosen is None) == (not vtc.backlogged)
        if chosen is not None:
            assert vtc.counter(chosen) == min(vtc.counter(t) for t in vtc.backlogged)
            server.step()
        candidates = [names[i] for i in subset if names[i] in vtc.backlogged]
        picked = vtc.select(candidates)
        assert (picked is None) == (not candidates)
        assert picked is None or picked in candidates


# ---------------------------------------------------------------------------------- lift branches


def backlogged_with(vtc: VirtualTokenCounter, counters: dict[str, int]) -> None:
    """Make every named tenant backlogged, then charge it up to the given counter (weight 1, w_p 1)."""
    for tenant in counters:
        vtc.on_backlogged(tenant)
    for tenant, target in counters.items():
        vtc.charge_input(tenant, target - int(vtc.counter(tenant)))


def test_lift_to_min_of_other_backlogged_tenants() -> None:
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0, "b": 1.0, "c": 1.0})
    backlogged_with(vtc, {"a": 100, "b": 40})
    assert vtc.on_backlogged("c") is True
    assert vtc.counter("c") == 40.0  # min over Q = {a, b}, line 11


def test_lift_never_lowers_a_counter() -> None:
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0, "b": 1.0})
    backlogged_with(vtc, {"a": 10, "b": 90})
    vtc.on_idle("b")
    vtc.on_backlogged("b")
    assert vtc.counter("b") == 90.0


def test_lift_to_last_tenant_that_left_when_queue_is_empty() -> None:
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0, "b": 1.0, "c": 1.0})
    backlogged_with(vtc, {"a": 500, "b": 300})
    vtc.on_idle("a")
    vtc.on_idle("b")  # b leaves last, with 300 (a has 500)
    assert vtc.last_left == "b"
    vtc.on_backlogged("c")  # Q is empty: lines 7-9
    assert vtc.counter("c") == 300.0


def test_last_left_counter_is_read_at_lift_time() -> None:
    vtc = VirtualTokenCounter(VTCWeights(w_q=2.0), {"a": 1.0, "b": 1.0})
    backlogged_with(vtc, {"a": 100})
    vtc.on_idle("a")
    vtc.charge_output("a", 10)  # a's running requests keep decoding after its queue emptied
    vtc.on_backlogged("b")
    assert vtc.counter("b") == 120.0


def test_stale_newcomer_cannot_starve_returning_tenants() -> None:
    # Skipping the empty-queue lift (the VTC artifact) leaves c at 0 here, and a later returns to a
    # queue whose minimum is 0: c would then be served alone for 1000 tokens.
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0, "c": 1.0})
    backlogged_with(vtc, {"a": 1000})
    vtc.on_idle("a")
    vtc.on_backlogged("c")
    vtc.on_backlogged("a")
    assert vtc.counter("c") == vtc.counter("a") == 1000.0


def test_no_lift_before_anyone_was_backlogged_and_none_while_backlogged() -> None:
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0, "b": 1.0})
    vtc.charge_input("a", 7)
    assert vtc.on_backlogged("a") is True and vtc.counter("a") == 7.0
    backlogged_with(vtc, {"b": 50})
    assert vtc.on_backlogged("a") is False  # already backlogged: line 6, no lift
    assert vtc.counter("a") == 7.0
    assert vtc.on_idle("a") is True and vtc.on_idle("a") is False


def test_charges_divide_by_tenant_weight() -> None:
    vtc = VirtualTokenCounter(VTCWeights(w_p=1.0, w_q=2.0, w_r=3.0), {"a": 2.0})
    assert vtc.charge_input("a", 10) == 5.0
    assert vtc.charge_output("a", 10) == 15.0
    assert vtc.charge_finetune("a", 10) == 30.0


def test_ties_go_to_the_smallest_name() -> None:
    vtc = VirtualTokenCounter(VTCWeights(), {"b": 1.0, "a": 1.0, "c": 1.0})
    for name in ("c", "b", "a"):
        vtc.on_backlogged(name)
    assert vtc.select() == "a"
    assert vtc.select(["c", "b"]) == "b"


def test_backward_tasklets_of_a_window_sum_to_its_tokens() -> None:
    tasklets = [backward_tasklet_tokens(48, layers, 12) for layers in (5, 4, 3)]
    assert sum(tasklets) == 48.0
    assert backward_tasklet_tokens(48, 12, 12) == 48.0


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["w_p", "w_q", "w_r"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_bad_token_weight_names_the_setting(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be"):
        VTCWeights(**{name: value})


@pytest.mark.parametrize("weight", [0.0, -2.0, math.nan])
def test_bad_tenant_weight_names_the_tenant(weight: float) -> None:
    with pytest.raises(ValueError, match="weight of tenant 'acme'"):
        VirtualTokenCounter(VTCWeights(), {"acme": weight})


def test_unknown_duplicate_and_unbacklogged_tenants_rejected() -> None:
    vtc = VirtualTokenCounter(VTCWeights(), {"a": 1.0})
    with pytest.raises(ValueError, match="already registered"):
        vtc.add_tenant("a")
    with pytest.raises(ValueError, match="unknown tenant 'z'"):
        vtc.charge_output("z", 1)
    with pytest.raises(ValueError, match="unknown tenant 'z'"):
        vtc.on_backlogged("z")
    with pytest.raises(ValueError, match="'a' is not backlogged"):
        vtc.select(["a"])
    with pytest.raises(ValueError, match="num_tokens must be"):
        vtc.charge_finetune("a", -1)


@pytest.mark.parametrize("args", [(-1, 1, 2), (4, 3, 2), (4, -1, 2), (4, 0, 0)])
def test_bad_tasklet_arguments_rejected(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="must be"):
        backward_tasklet_tokens(*args)
