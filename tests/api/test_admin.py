"""Admin keys, `/metrics` protection and quota status codes, through the real `--local` server and the
official `openai` client: an admin key reads `/metrics` with tenant labels and manages every tenant's
fine-tuning jobs but cannot act as a tenant; `/metrics` is refused without one (or, with
`public_metrics`, served with tenant labels summed away); a limit that can never clear is a 403, a
temporary one a 429 with `Retry-After`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from local_server import ADMIN_KEY, LocalServer, local_server, scrape, upload_jsonl

ALPHA, BETA = "sk-alpha-admin-test-01", "sk-beta-admin-test-01"
TENANTS = {"alpha": {"api_keys": [ALPHA], "limits": {"max_concurrent_jobs": 1}},
           "beta": {"api_keys": [BETA], "limits": {"max_concurrent_jobs": 0}}}
LINES = [{"messages": [{"role": "user", "content": f"Say {i}"},
                       {"role": "assistant", "content": f"{i}."}]} for i in range(12)]
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(llama_dir, tmp_path_factory.mktemp("admin"), TENANTS) as srv:
        yield srv


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _chat(srv: LocalServer, key: str) -> None:
    srv.client(key).chat.completions.create(model=srv.base, messages=HELLO, max_tokens=3,
                                            extra_body={"ignore_eos": True})


def test_metrics_need_an_admin_key(server: LocalServer) -> None:
    _chat(server, ALPHA)
    anonymous = httpx.get(f"{server.url}/metrics")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    tenant = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ALPHA}"})
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    assert _sample(scrape(server.url), "coserve_tokens_total", kind="completion", tenant="alpha") >= 3


def test_public_metrics_sum_tenants_away(llama_dir: Path, tmp_path: Path) -> None:
    with local_server(llama_dir, tmp_path, TENANTS, public_metrics=True) as srv:
        _chat(srv, ALPHA)
        _chat(srv, BETA)
        public = httpx.get(f"{srv.url}/metrics")
        assert public.status_code == 200 and "tenant=" not in public.text
        full = scrape(srv.url)
        per_tenant = [_sample(full, "coserve_tokens_total", kind="completion", tenant=t) for t in TENANTS]
        assert min(per_tenant) >= 3
        assert _sample(public.text, "coserve_tokens_total", kind="completion") == sum(per_tenant)
        assert (_sample(public.text, "coserve_time_to_first_token_seconds_count")
                == _sample(full, "coserve_time_to_first_token_seconds_count"))
        # A tenant's key sees the public view; a wrong key is still a 401.
        tenant = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {ALPHA}"})
        assert tenant.status_code == 200 and "tenant=" not in tenant.text
        assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sk-nope"}).status_code == 401


def test_admin_manages_every_tenants_jobs(server: LocalServer) -> None:
    alpha, admin = server.client(ALPHA), server.client(ADMIN_KEY)
    job = alpha.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(alpha, LINES),
                                        hyperparameters={"n_epochs": 50})
    listed = {j.id: j.organization_id for j in admin.fine_tuning.jobs.list(limit=100).data}
    assert listed[job.id] == "alpha"
    assert admin.fine_tuning.jobs.retrieve(job.id).id == job.id
    assert admin.fine_tuning.jobs.list_events(job.id).data
    assert admin.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    assert alpha.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    events = [e.message for e in alpha.fine_tuning.jobs.list_events(job.id).data]
    assert any("cancelled by request" in message for message in events), events
    with pytest.raises(openai.NotFoundError):
        admin.fine_tuning.jobs.retrieve("ftjob-000000000000000000000000")
    with pytest.raises(openai.NotFoundError):  # tenants still see only their own jobs
        server.client(BETA).fine_tuning.jobs.retrieve(job.id)
    assert job.id not in {j.id for j in server.client(BETA).fine_tuning.jobs.list().data}


def test_admin_key_is_not_a_tenant(server: LocalServer) -> None:
    admin = server.client(ADMIN_KEY)
    calls = [lambda: admin.chat.completions.create(model=server.base, messages=HELLO, max_tokens=1),
             lambda: upload_jsonl(admin, LINES),
             lambda: admin.fine_tuning.jobs.create(model=server.base, training_file="file-x")]
    for call in calls:
        with pytest.raises(openai.PermissionDeniedError) as err:
            call()
        assert err.value.body["code"] == "admin_key_not_allowed", err.value.body


def test_quota_that_never_clears_is_403_and_a_full_slot_429(server: LocalServer) -> None:
    beta = server.client(BETA)
    body = {"model": server.base, "training_file": upload_jsonl(beta, LINES)}
    refused = httpx.post(f"{server.url}/v1/fine_tuning/jobs", json=body,
                         headers={"Authorization": f"Bearer {BETA}"})
    assert refused.status_code == 403 and "retry-after" not in refused.headers
    assert refused.json()["error"]["code"] == "quota_exceeded"
    with pytest.raises(openai.PermissionDeniedError):
        beta.fine_tuning.jobs.create(**body)

    alpha = server.client(ALPHA)
    file_id = upload_jsonl(alpha, LINES)
    first = alpha.fine_tuning.jobs.create(model=server.base, training_file=file_id,
                                          hyperparameters={"n_epochs": 50})
    try:
        busy = httpx.post(f"{server.url}/v1/fine_tuning/jobs", json={"model": server.base,
                                                                     "training_file": file_id},
                          headers={"Authorization": f"Bearer {ALPHA}"})
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) > 0
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        server.client(ADMIN_KEY).fine_tuning.jobs.cancel(first.id)
