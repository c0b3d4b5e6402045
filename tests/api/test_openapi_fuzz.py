"""Schemathesis fuzzing of the real gateway against its own `/openapi.json`: no request gets a 5xx.

The server is the `--local` one (uvicorn, the SchedulerActor, the engine loop over a tiny Llama), as in
`test_fine_tuning_http.py`. The schema is loaded from the running server, and every operation in it is
sent generated requests with a tenant's API key:

- positive cases (valid per the schema) and negative cases (invalid per the schema), made by schemathesis;
- for operations that take a file, job or model id, positive cases that name real ones (a fine-tuning
  file, a finished job, its fine-tuned model and checkpoint), so the fuzzing reaches past the 404.

The only check is schemathesis' `not_a_server_error`: whatever a client sends must be answered with a
2xx/4xx (a 4xx in OpenAI's error shape is the gateway's business, tested elsewhere), never a 5xx.
Generation is bounded and derandomized: the run is fast and the same on every machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup

from local_server import local_server

KEY = "sk-fuzz-tenant-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Per operation and kind of case (positive, negative, with real ids): some 800 requests in all.
MAX_EXAMPLES = 20
# A request that has not been answered by then fails the run: a hang is as bad as a 5xx.
REQUEST_TIMEOUT_S = 30.0
CHAT_PATH = "/v1/chat/completions"
# Generated chats naming a real model are capped at these: uncapped, the tiny model on CPU needs seconds
# per choice for a full context (2k tokens) and minutes for `n: 128`. The other chats name no model the
# server has and are refused before the engine, so they are sent as generated.
MAX_CHOICES, MAX_COMPLETION_TOKENS = 4, 8
TRAIN_LINES = [{"messages": [{"role": "user", "content": f"Say {i}"},
                             {"role": "assistant", "content": f"{i}."}]} for i in range(10)]

SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@dataclass(frozen=True)
class Seeded:
    """Real resources of the fuzzing tenant, by the parameter names the API uses for them."""

    file_id: str
    job_id: str
    models: tuple[str, ...]  # the base model, a fine-tuned model, one of its checkpoints

    def path_values(self) -> dict[str, Sequence[str]]:
        return {"file_id": [self.file_id], "job_id": [self.job_id], "model": self.models}

    def body_values(self) -> dict[str, Sequence[str]]:
        # `purpose`: the one this server accepts, so uploads get as far as the content's validation.
        return {"model": self.models, "training_file": [self.file_id], "validation_file": [self.file_id],
                "purpose": ["fine-tune"]}


@dataclass(frozen=True)
class Server:
    url: str
    seeded: Seeded


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Fuzzed job creations that name the real file start real training: the limits keep it to one short
    # job at a time (the rest get 429 or fail their quota), so the run stays fast.
    limits = {"max_concurrent_jobs": 1, "max_training_tokens_per_job": 2000}
    tenants = {"fuzz": {"api_keys": [KEY], "limits": limits}}
    with local_server(llama_dir, tmp_path_factory.mktemp("openapi-fuzz"), tenants) as srv:
        yield Server(url=srv.url, seeded=_seed(srv.url, srv.base))


def _seed(url: str, base: str) -> Seeded:
    """Upload a training file and fine-tune on it (one step) for real ids to fuzz with."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        data = "\n".join(json.dumps(line) for line in TRAIN_LINES).encode()
        file_id = _ok(http.post("/v1/files", data={"purpose": "fine-tune"},
                                files={"file": ("train.jsonl", data)}))["id"]
        job = _ok(http.post("/v1/fine_tuning/jobs", json={
            "model": base, "training_file": file_id,
            "hyperparameters": {"n_epochs": 1, "batch_size": len(TRAIN_LINES)}}))
        deadline = time.monotonic() + 60
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"seed job {job['id']} did not finish"
            time.sleep(0.1)
            job = _ok(http.get(f"/v1/fine_tuning/jobs/{job['id']}"))
        assert job["status"] == "succeeded", job["error"]
        checkpoints = _ok(http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints"))["data"]
    return Seeded(file_id=file_id, job_id=job["id"],
                  models=(base, job["fine_tuned_model"], checkpoints[0]["fine_tuned_model_checkpoint"]))


def _ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def _operations(server: Server) -> list[APIOperation]:
    """The operations of the server's published schema, deletions and cancels last: until then the
    seeded file, job and models exist for the other operations."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        operations.append(result.ok())  # an operation schemathesis cannot read fails the test here
    return sorted(operations, key=lambda op: op.method.upper() == "DELETE" or op.path.endswith("/cancel"))


def _with_seeded_ids(operation: APIOperation, seeded: Seeded) -> st.SearchStrategy[Case] | None:
    """Positive cases of `operation` whose id parameters and body fields name real resources; None when
    it takes neither ids nor a body."""
    path_values = seeded.path_values()
    fixed = [{p.name: value} for p in operation.path_parameters if p.name in path_values
             for value in path_values[p.name]]
    if not fixed and not list(operation.body):
        return None
    cases = (st.one_of([operation.as_strategy(GenerationMode.POSITIVE, path_parameters=params)
                        for params in fixed]) if fixed else operation.as_strategy(GenerationMode.POSITIVE))
    body_values = seeded.body_values()

    @st.composite
    def seeded_case(draw: st.DrawFn) -> Case:
        case = draw(cases)
        if isinstance(case.body, dict):
            for name, values in body_values.items():
                if name in case.body:  # optional fields stay absent when the generator left them out
                    case.body[name] = draw(st.sampled_from(values))
            if operation.path == CHAT_PATH:
                _cap_chat_cost(case.body)
        return case

    return seeded_case()


def _cap_chat_cost(body: dict[str, Any]) -> None:
    """Cap the choices and tokens a valid chat body asks for (see MAX_CHOICES); nothing else changes."""
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], MAX_CHOICES)
    # `max_completion_tokens` wins over `max_tokens`: setting it bounds the output whatever else is sent.
    requested = body.get("max_completion_tokens")
    body["max_completion_tokens"] = min(requested, MAX_COMPLETION_TOKENS) if isinstance(requested, int) \
        else MAX_COMPLETION_TOKENS


def _run(strategy: st.SearchStrategy[Case], send: Callable[[Case], None]) -> None:
    # Hypothesis drives each operation here rather than schemathesis' pytest integration: the schema
    # comes from a fixture (the running server), and `schemathesis.pytest.from_fixture(...).parametrize()`
    # (4.32) breaks under pytest 9.2, setting `Node._nodeid`, which pytest no longer has.
    @SETTINGS
    @given(case=strategy)
    def fuzz(case: Case) -> None:
        send(case)

    fuzz()


def test_no_operation_answers_5xx(server: Server) -> None:
    def send(case: Case) -> None:
        # The schema declares no security scheme (auth is a FastAPI dependency reading the header), so
        # the key goes on every request here; without it each /v1 route would stop at the 401.
        case.call_and_validate(base_url=server.url, headers=AUTH, checks=[not_a_server_error],
                               timeout=REQUEST_TIMEOUT_S)

    failures: dict[str, str] = {}
    operations = _operations(server)
    labels = {op.label for op in operations}
    assert {"POST /v1/chat/completions", "POST /v1/files", "POST /v1/fine_tuning/jobs"} <= labels, labels
    for operation in operations:
        strategies: Mapping[str, st.SearchStrategy[Case] | None] = {
            "positive": operation.as_strategy(GenerationMode.POSITIVE),
            "negative": operation.as_strategy(GenerationMode.NEGATIVE),
            "seeded": _with_seeded_ids(operation, server.seeded),
        }
        for kind, strategy in strategies.items():
            if strategy is None:
                continue
            try:
                _run(strategy, send)
            except Unsatisfiable:
                # Every input the operation takes is valid (a free-form path id, no query, no body):
                # there is no negative case to send.
                assert kind == "negative", f"{operation.label}: no {kind} case could be generated"
            # Every failing operation is reported, not only the first. A FailureGroup (the checks' verdict,
            # with a curl line reproducing the request) is a BaseExceptionGroup, not an Exception.
            except (FailureGroup, Exception) as exc:  # noqa: BLE001
                failures[f"{operation.label} ({kind})"] = f"{type(exc).__name__}: {exc}"
    assert not failures, "\n\n".join(f"{label}\n{message}" for label, message in failures.items())
