"""`AdmissionControl`: one live request per key, the tenants' request and token quotas (429 with the wait,
400 for what never fits, refunds), the later prompts of one completions request counted once, and one
engine adapter id per adapter folder."""

from __future__ import annotations

from coserve.actors.admission import AdmissionControl, Charge
from coserve.contract.messages import AdapterSpec, Rejection, TokenSubmission
from coserve.contract.sampling import EosIds, SamplingParams
from coserve.tenancy.quotas import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sub(request_id: str, tenant: str = "t", prompt: int = 10, max_tokens: int = 20, n: int = 1,
        client_max: int | None = 20, adapter: AdapterSpec | None = None, counts: bool = True) -> TokenSubmission:
    return TokenSubmission(request_id=request_id, tenant=tenant, prompt_token_ids=list(range(prompt)),
                           sampling=SamplingParams(max_tokens=max_tokens, n=n), eos=EosIds(eos=0, extra=()),
                           adapter=adapter, client_max_tokens=client_max, counts_request=counts)


def test_a_key_in_use_is_refused() -> None:
    control = AdmissionControl({})
    assert isinstance(control.admit(sub("a"), key_in_use=False), Charge)
    refused = control.admit(sub("a"), key_in_use=True)
    assert isinstance(refused, Rejection) and (refused.status, refused.param) == (409, "request_id")


def test_token_quota_waits_refunds_and_never_fits() -> None:
    clock = Clock()
    control = AdmissionControl({"q": TenantLimits(tokens_per_minute=100)}, clock)
    first = control.admit(sub("a", tenant="q", prompt=10, max_tokens=20, n=3), key_in_use=False)
    assert isinstance(first, Charge) and first.estimate == 10 + 3 * 20
    waiting = control.admit(sub("b", tenant="q", prompt=10, max_tokens=30), key_in_use=False)
    assert isinstance(waiting, Rejection) and waiting.status == 429 and waiting.retry_after_s > 0
    control.refund("q", 50)  # the first request used only 20 of its 70
    assert isinstance(control.admit(sub("b", tenant="q", prompt=10, max_tokens=30), key_in_use=False), Charge)
    never = control.admit(sub("c", tenant="q", prompt=10, max_tokens=200, client_max=200), key_in_use=False)
    assert isinstance(never, Rejection) and never.status == 400 and never.retry_after_s is None
    assert isinstance(control.admit(sub("d", tenant="other", max_tokens=10**6), key_in_use=False), Charge)


def test_no_client_limit_is_charged_up_to_the_bucket() -> None:
    control = AdmissionControl({"q": TenantLimits(tokens_per_minute=100)})
    charge = control.admit(sub("a", tenant="q", prompt=10, max_tokens=4000, client_max=None), key_in_use=False)
    assert isinstance(charge, Charge) and charge.estimate == 100


def test_later_prompts_of_one_request_take_tokens_but_no_request() -> None:
    control = AdmissionControl({"q": TenantLimits(requests_per_minute=1)})
    assert isinstance(control.admit(sub("a-0", tenant="q"), key_in_use=False), Charge)
    assert isinstance(control.admit(sub("a-1", tenant="q", counts=False), key_in_use=False), Charge)
    refused = control.admit(sub("b-0", tenant="q"), key_in_use=False)
    assert isinstance(refused, Rejection) and refused.status == 429


def test_one_adapter_id_per_folder() -> None:
    control = AdmissionControl({})
    one, two = AdapterSpec("ft:a", "/data/adapters/a"), AdapterSpec("ft:b", "/data/adapters/b")
    ids = [control.admit(sub(f"r{i}", adapter=spec), key_in_use=False).adapter.adapter_id
           for i, spec in enumerate([one, two, one])]
    assert ids == [1, 2, 1]
    assert control.admit(sub("base"), key_in_use=False).adapter is None
