"""The gateway's files and models endpoints, served by real uvicorn and driven by the official `openai`
client: upload/list/retrieve/content/delete, pagination, tenant isolation, and OpenAI-shaped errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from coserve.api.app import build_app
from coserve.store import MetadataStore
from coserve.tenancy.tenants import parse_tenants
from uvicorn_thread import serve_in_thread

ACME_KEY = "sk-acme-0123456789"
GLOBEX_KEY = "sk-globex-0123456789"
BASE = "tiny-llama"
HF_BASE = "org/tiny-chat"  # a base id with "/", like Hugging Face names
ACME_FT = f"ft:{BASE}:acme:sfx:ab12cd34"
GLOBEX_FT = f"ft:{BASE}:globex:sfx:ef56gh78"
MAX_UPLOAD = 8 * 1024
GOOD_LINE = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}]})


@dataclass
class Gateway:
    url: str
    store: MetadataStore


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    """The real app on 127.0.0.1 and a free port, served by uvicorn in a background thread."""
    store = MetadataStore(tmp_path / "data")
    tenants = parse_tenants({"tenants": {"acme": {"api_keys": [ACME_KEY]},
                                         "globex": {"api_keys": [GLOBEX_KEY]}}})
    store.models.register(ACME_FT, tenant="acme", base_model=BASE)
    store.models.register(GLOBEX_FT, tenant="globex", base_model=BASE)
    app = build_app(store, tenants, [BASE, HF_BASE], max_upload_bytes=MAX_UPLOAD)
    with serve_in_thread(app, lifespan="off", timeout_s=10) as url:
        yield Gateway(url=url, store=store)
    store.close()


def client(gw: Gateway, key: str = ACME_KEY) -> openai.OpenAI:
    """The official client; no retries, so an error surfaces at once."""
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=10)


def jsonl(n: int) -> bytes:
    return ("\n".join([GOOD_LINE] * n) + "\n").encode()


def test_upload_retrieve_content_delete(gateway: Gateway) -> None:
    oa = client(gateway)
    data = jsonl(3)
    created = oa.files.create(file=("train.jsonl", data), purpose="fine-tune")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.filename, created.bytes, created.purpose, created.status) == \
        ("train.jsonl", len(data), "fine-tune", "processed")
    assert oa.files.retrieve(created.id) == created
    assert oa.files.content(created.id).read() == data
    deleted = oa.files.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    with pytest.raises(openai.NotFoundError):
        oa.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        oa.files.delete(created.id)


def test_list_pagination(gateway: Gateway) -> None:
    oa = client(gateway)
    ids = [oa.files.create(file=(f"f{i}.jsonl", jsonl(1)), purpose="fine-tune").id for i in range(5)]
    newest_first = ids[::-1]
    page = oa.files.list(limit=2)
    assert [f.id for f in page.data] == newest_first[:2] and page.has_more is True
    last = oa.files.list(limit=2, after=newest_first[3])
    assert [f.id for f in last.data] == newest_first[4:] and last.has_more is False
    # The client's auto-pagination follows `after` until has_more is false.
    assert [f.id for f in oa.files.list(limit=2)] == newest_first
    assert [f.id for f in oa.files.list(limit=3, order="asc")] == ids
    assert [f.id for f in oa.files.list(purpose="fine-tune")] == newest_first
    assert list(oa.files.list(purpose="batch")) == []
    raw = httpx.get(f"{gateway.url}/v1/files", params={"limit": 2},
                    headers={"Authorization": f"Bearer {ACME_KEY}"}).json()
    assert (raw["object"], raw["first_id"], raw["last_id"]) == ("list", newest_first[0], newest_first[1])


def test_bad_jsonl_names_first_bad_line(gateway: Gateway) -> None:
    oa = client(gateway)
    bad = f"{GOOD_LINE}\n{GOOD_LINE}\n{{\"messages\": []}}\nnot json\n".encode()
    with pytest.raises(openai.BadRequestError) as info:
        oa.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert info.value.status_code == 400
    assert info.value.code == "invalid_file_format" and info.value.param == "file"
    assert "Line 3" in info.value.message
    assert list(oa.files.list()) == []  # nothing stored


def test_unsupported_purpose_and_size_limit(gateway: Gateway) -> None:
    oa = client(gateway)
    with pytest.raises(openai.BadRequestError) as info:
        oa.files.create(file=("x.jsonl", jsonl(1)), purpose="batch")
    assert info.value.param == "purpose"
    too_big = jsonl(MAX_UPLOAD // len(GOOD_LINE) + 1)
    with pytest.raises(openai.APIStatusError) as big:
        oa.files.create(file=("big.jsonl", too_big), purpose="fine-tune")
    assert big.value.status_code == 413 and big.value.param == "file"


def test_body_over_limit_is_413_declared_or_chunked(gateway: Gateway) -> None:
    boundary = "b0undary"
    headers = {"Authorization": f"Bearer {ACME_KEY}",
               "Content-Type": f"multipart/form-data; boundary={boundary}"}
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n"
            ).encode() + b"x" * (MAX_UPLOAD + 128 * 1024) + f"\r\n--{boundary}--\r\n".encode()
    declared = httpx.post(f"{gateway.url}/v1/files", content=body, headers=headers)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        # A generator body goes out chunked, without Content-Length: only counting can catch it.
        for start in range(0, len(body), 16 * 1024):
            yield body[start:start + 16 * 1024]

    chunked = httpx.post(f"{gateway.url}/v1/files", content=chunks(), headers=headers)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    assert list(client(gateway).files.list()) == []


def test_authentication(gateway: Gateway) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(gateway, key="sk-wrong-0123456789").files.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert "Incorrect API key provided" in info.value.message
    assert "sk-wrong-0123456789" not in info.value.message  # masked
    missing = httpx.get(f"{gateway.url}/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def test_another_tenants_file_is_404(gateway: Gateway) -> None:
    mine = client(gateway).files.create(file=("t.jsonl", jsonl(1)), purpose="fine-tune")
    theirs = client(gateway, GLOBEX_KEY)
    for call in (theirs.files.retrieve, theirs.files.content, theirs.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(mine.id)
    assert list(theirs.files.list()) == []
    with pytest.raises(openai.BadRequestError) as info:  # another tenant's id is no cursor either
        theirs.files.list(after=mine.id)
    assert info.value.param == "after"
    assert client(gateway).files.retrieve(mine.id).id == mine.id  # still there for its owner


def test_models_list_retrieve_delete(gateway: Gateway) -> None:
    oa = client(gateway)
    listed = {m.id: m for m in oa.models.list()}
    assert list(listed) == [BASE, HF_BASE, ACME_FT]  # bases first, never globex's
    assert listed[BASE].owned_by == "system" and listed[ACME_FT].owned_by == "acme"
    assert oa.models.retrieve(ACME_FT).id == ACME_FT  # ids with ':' and '/' route whole
    assert oa.models.retrieve(HF_BASE).owned_by == "system"
    for call in (oa.models.retrieve, oa.models.delete):
        with pytest.raises(openai.NotFoundError) as info:
            call(GLOBEX_FT)
        assert info.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError):
        oa.models.delete(BASE)
    assert oa.models.delete(ACME_FT).deleted is True
    assert [m.id for m in oa.models.list()] == [BASE, HF_BASE]
    assert [m.id for m in client(gateway, GLOBEX_KEY).models.list()] == [BASE, HF_BASE, GLOBEX_FT]
    assert all(m.model_extra.get("coserve") is None for m in oa.models.list())  # no engine behind this app


def test_the_served_base_model_says_its_engine_and_dtype(tmp_path: Path) -> None:
    """The base model's `coserve` extension field names the engine and the dtype serving (what the engine's
    layout says: `coserve serve` passes it; the vLLM server's test checks it end to end); the OpenAI fields
    are OpenAI's, and a fine-tuned model has no such field. In-process app: a whole engine per test would
    add to the suite's memory for nothing this checks."""
    from coserve.api.protocol.models import ModelServing

    store = MetadataStore(tmp_path / "data")
    tenants = parse_tenants({"tenants": {"acme": {"api_keys": [ACME_KEY]}}})
    app = build_app(store, tenants, [BASE], serving=ModelServing(engine="torch", dtype="float32"))
    with serve_in_thread(app, lifespan="off", timeout_s=10) as url:
        base = httpx.get(f"{url}/v1/models/{BASE}", headers={"Authorization": f"Bearer {ACME_KEY}"})
        assert base.status_code == 200
        assert base.json() == {"id": BASE, "object": "model", "created": base.json()["created"],
                               "owned_by": "system", "shutdown_date": None, "parent": None, "root": BASE,
                               "coserve": {"engine": "torch", "dtype": "float32"}}
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=ACME_KEY, max_retries=0)
        assert oa.models.retrieve(BASE).model_extra["coserve"] == {"engine": "torch", "dtype": "float32"}
        store.models.register(f"ft:{BASE}:acme:sfx:ab12cd34", tenant="acme", base_model=BASE)
        listed = {m.id: m.model_extra.get("coserve") for m in oa.models.list()}
        assert listed == {BASE: {"engine": "torch", "dtype": "float32"}, f"ft:{BASE}:acme:sfx:ab12cd34": None}



@pytest.mark.parametrize("path", [
    "/v1/files/..%2Fmetadata.sqlite3", "/v1/files/..%2Fmetadata.sqlite3/content",
    "/v1/files/file-..%2F..%2F..%2Fetc%2Fpasswd/content", "/v1/files/%2E%2E/content",
    "/v1/models/..%2F..%2Fmetadata.sqlite3", "/v1/models/../../metadata.sqlite3/adapter",
    "/v1/models/ft:tiny-llama:acme:sfx:..%2F..%2Fetc/adapter", "/v1/fine_tuning/jobs/..%2F..%2Fjobs",
])
def test_ids_that_look_like_paths_reach_nothing(gateway: Gateway, path: str) -> None:
    # Ids are looked up, never joined into paths: whatever the encoding, an unknown id is a 404 (or the
    # router's own 404), with OpenAI's error body, and no byte of the data dir comes back.
    response = httpx.get(gateway.url + path, headers={"Authorization": f"Bearer {ACME_KEY}"})
    assert response.status_code == 404, (path, response.status_code, response.text[:200])
    assert "error" in response.json() and b"SQLite" not in response.content

def test_malformed_requests_are_400_not_422(gateway: Gateway) -> None:
    headers = {"Authorization": f"Bearer {ACME_KEY}"}
    no_purpose = httpx.post(f"{gateway.url}/v1/files", headers=headers,
                            files={"file": ("a.jsonl", jsonl(1))})
    assert no_purpose.status_code == 400
    assert no_purpose.json()["error"] == {"message": "Missing required parameter: 'purpose'.",
                                          "type": "invalid_request_error", "param": "purpose",
                                          "code": "missing_required_parameter"}
    no_file = httpx.post(f"{gateway.url}/v1/files", headers=headers, data={"purpose": "fine-tune"})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"purpose": "x"}, "purpose")):
        bad = httpx.get(f"{gateway.url}/v1/files", headers=headers, params=params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_unknown_route_health_and_server_error(gateway: Gateway) -> None:
    unknown = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "Invalid URL (GET /v1/nothing-here)"
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    schema = httpx.get(f"{gateway.url}/openapi.json", timeout=60).json()  # what schemathesis will read
    assert {"/v1/files", "/v1/files/{file_id}/content", "/v1/models/{model}"} <= set(schema["paths"])
    gateway.store.close()  # every store call now fails unexpectedly
    with pytest.raises(openai.InternalServerError) as info:
        client(gateway).models.list()
    assert info.value.status_code == 500 and info.value.type == "server_error"
