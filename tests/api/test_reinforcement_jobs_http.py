"""`method: reinforcement` at the gateway, through the real server (`--local`, the tiny llama) driven by
the official `openai` client: a job is created and echoes its grader and hyperparameters, and what it
cannot run is a 400 naming the param before the job exists (a grader it cannot run, a row without a
field the grader reads, a value out of range, a file of the wrong rows). The job's run is the scheduler's
(not awaited here). The python-graders switch is checked on `FineTuningService` over a real store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.fine_tuning import FineTuningJobCreate
from coserve.api.serving.fine_tuning import FineTuningService
from coserve.store import MetadataStore
from coserve.tenancy.tenants import parse_tenants
from local_server import LocalServer, local_server, upload_jsonl

KEY = "sk-rft-tenant-0123456789"
GRADER_PARAM = "method.reinforcement.grader"
EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}
PYTHON = {"type": "python", "name": "py",
          "source": "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"}
JUDGE = [{"role": "user", "content": "Is {{ sample.output_text }} the answer to {{ item.answer }}?"}]


def _row(i: int, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "Answer with a number."},
                         {"role": "user", "content": f"What is {i} plus {i}?"}],
            "answer": str(2 * i), "meta": {"tags": ["sum"]}, **fields}


ROWS = [_row(i) for i in range(12)]
CHAT = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}"}]}
        for i in range(12)]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(llama_dir, tmp_path_factory.mktemp("rft"), {"t": {"api_keys": [KEY]}}) as srv:
        yield srv


@pytest.fixture(scope="module")
def files(server: LocalServer) -> dict[str, str]:
    oa = server.client(KEY)
    no_answer = [{k: v for k, v in row.items() if k != "answer"} if i == 6 else row for i, row in enumerate(ROWS)]
    return {"rows": upload_jsonl(oa, ROWS), "chat": upload_jsonl(oa, CHAT), "no_answer": upload_jsonl(oa, no_answer),
            "short_validation": upload_jsonl(oa, [ROWS[0], {"messages": ROWS[1]["messages"]}])}


def _method(grader: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    return {"type": "reinforcement", "reinforcement": {"grader": grader or EXACT, **settings}}


def test_a_reinforcement_job_is_created_and_echoes_its_method(server: LocalServer, files: dict[str, str]) -> None:
    oa = server.client(KEY)
    hyperparameters = {"n_epochs": 1, "batch_size": 4, "compute_multiplier": 2, "eval_samples": 2}
    multi = {"type": "multi", "name": "mix", "calculate_output": "0.5 * exact + 0.5 * near",
             "graders": {"exact": EXACT, "near": {"type": "text_similarity", "name": "near",
                                                 "input": "{{ sample.output_text }}",
                                                 "reference": "{{ item.meta.tags[0] }}",
                                                 "evaluation_metric": "fuzzy_match"}}}
    created = oa.fine_tuning.jobs.with_raw_response.create(
        model=server.base, training_file=files["rows"], validation_file=files["rows"],
        method=_method(multi, hyperparameters=hyperparameters, max_completion_tokens=32))
    job = created.parse()
    try:
        assert job.status == "validating_files" and job.method is not None and job.method.type == "reinforcement"
        settings = job.method.reinforcement
        assert settings is not None and settings.hyperparameters is not None
        hp = settings.hyperparameters
        assert (hp.n_epochs, hp.batch_size, hp.compute_multiplier, hp.eval_samples) == (1, 4, 2.0, 2)
        assert (hp.eval_interval, hp.learning_rate_multiplier, hp.reasoning_effort) == ("auto", "auto", "default")
        # The grader as given (the SDK's grader union parses a multi grader loosely: read the JSON), and
        # the coserve extension beside it.
        for echo in (created.http_response.json(),
                     oa.fine_tuning.jobs.with_raw_response.retrieve(job.id).http_response.json()):
            assert echo["method"]["reinforcement"]["grader"] == multi
            assert echo["method"]["reinforcement"]["max_completion_tokens"] == 32
    finally:
        if oa.fine_tuning.jobs.retrieve(job.id).status not in ("succeeded", "failed", "cancelled"):
            oa.fine_tuning.jobs.cancel(job.id)


@pytest.mark.parametrize(("patch", "param", "words"), [
    ({"training_file": "no_answer"}, GRADER_PARAM, "{{ item.answer }}, and row 7 of the training_file"),
    ({"validation_file": "short_validation"}, GRADER_PARAM, "row 2 of the validation_file"),
    ({"method": _method({**EXACT, "reference": "{{ item.answer"})}, f"{GRADER_PARAM}.reference", "not closed"),
    ({"method": _method({**EXACT, "reference": "{{ row.answer }}"})}, f"{GRADER_PARAM}.reference", "'row'"),
    ({"method": _method({**EXACT, "operation": "regex"})}, f"{GRADER_PARAM}.operation", ""),
    ({"method": _method(PYTHON)}, f"{GRADER_PARAM}.type", "--enable-python-graders"),
    ({"method": _method({"type": "score_model", "name": "s", "model": "m", "input": JUDGE})},
     f"{GRADER_PARAM}.model", "'m' is not a model this server serves to you"),
    ({"method": _method({"type": "label_model", "name": "l", "model": "m", "input": JUDGE, "labels": ["y", "n"],
                         "passing_labels": ["y"]})}, f"{GRADER_PARAM}.type", "in OpenAI's API either"),
    ({"method": _method({"type": "multi", "name": "m", "calculate_output": "exact * judge", "graders": {
        "exact": EXACT, "judge": {"type": "score_model", "name": "j", "model": "m", "input": JUDGE}}})},
     f"{GRADER_PARAM}.graders.judge.model", "not a model this server serves to you"),
])
def test_a_grader_it_cannot_run_is_a_400_naming_the_field(server: LocalServer, files: dict[str, str],
                                                         patch: dict[str, Any], param: str, words: str) -> None:
    error = _refusal(server, files, patch)
    assert error["param"] == param and error["code"] == "invalid_grader", error
    assert words in error["message"], error


@pytest.mark.parametrize(("patch", "param", "words"), [
    ({"method": _method(hyperparameters={"compute_multiplier": 100})},
     "method.reinforcement.hyperparameters.compute_multiplier", "0.5 to 8"),
    ({"method": _method(hyperparameters={"eval_samples": 0})}, "method.reinforcement.hyperparameters.eval_samples", ""),
    ({"method": _method(hyperparameters={"eval_samples": 1000})},
     "method.reinforcement.hyperparameters.eval_samples", ""),
    ({"method": _method(hyperparameters={"reasoning_effort": "high"})},
     "method.reinforcement.hyperparameters.reasoning_effort", "no reasoning mode"),
    ({"method": _method(hyperparameters={"n_epochs": 0})}, "method.reinforcement.hyperparameters.n_epochs", ""),
    ({"method": _method(max_completion_tokens=0)}, "method.reinforcement.max_completion_tokens", ""),
    ({"method": _method(max_completion_tokens=10**6)}, "method.reinforcement.max_completion_tokens", ""),
    ({"method": _method(temperature=1.0)}, "method.reinforcement.temperature", ""),
    ({"method": {"type": "reinforcement"}}, "method.reinforcement", "grader"),
    ({"method": _method(hyperparameters={"n_epochs": 2}), "hyperparameters": {"n_epochs": 1}}, "hyperparameters",
     "not both"),
    ({"method": _method(), "training_file": "chat"}, "training_file", "holds chat rows"),
    ({"method": _method(), "validation_file": "chat"}, "validation_file", "holds chat rows"),
    ({"method": {"type": "supervised"}}, "training_file", "holds reinforcement rows"),
    ({"method": None}, "training_file", "holds reinforcement rows"),  # no method: supervised
])
def test_bad_reinforcement_requests_are_400s_naming_the_param(server: LocalServer, files: dict[str, str],
                                                              patch: dict[str, Any], param: str, words: str) -> None:
    error = _refusal(server, files, patch)
    assert error["param"] == param and words in error["message"], error


def test_the_deprecated_hyperparameters_still_apply_to_a_reinforcement_job(server: LocalServer,
                                                                             files: dict[str, str]) -> None:
    oa = server.client(KEY)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=files["rows"], hyperparameters={"n_epochs": 2},
                                     method=_method())
    try:
        assert job.method is not None and job.method.reinforcement is not None
        hp = job.method.reinforcement.hyperparameters
        assert hp is not None and hp.n_epochs == 2 and hp.compute_multiplier == "auto"
    finally:
        if oa.fine_tuning.jobs.retrieve(job.id).status not in ("succeeded", "failed", "cancelled"):
            oa.fine_tuning.jobs.cancel(job.id)


def test_a_dedicated_reinforcement_job_is_a_400(server: LocalServer, files: dict[str, str]) -> None:
    """A reinforcement job cannot train dedicated (`training.mode`); this `--local` server has no dedicated
    runs at all, which it may say first: a 400 naming `training.mode` either way."""
    error = _refusal(server, files, {"method": _method(), "extra_body": {"training": {"mode": "dedicated"}}})
    assert error["param"] == "training.mode", error


def _refusal(server: LocalServer, files: dict[str, str], patch: dict[str, Any]) -> dict[str, Any]:
    """The 400's error body of a create request: `ROWS` and `EXACT`, with `patch` (a file by its name)."""
    body: dict[str, Any] = {"model": server.base, "training_file": files["rows"], "method": _method(), **patch}
    for key in ("training_file", "validation_file"):
        body[key] = files.get(body.get(key, ""), body.get(key))
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as info:
        server.client(KEY).fine_tuning.jobs.create(**body)
    error = info.value.body
    assert isinstance(error, dict), error
    return error


TENANTS = parse_tenants({"tenants": {"acme": {"api_keys": ["sk-acme"]}}})


@pytest.mark.parametrize("python", [False, True])
def test_python_graders_follow_the_servers_switch(tmp_path: Path, python: bool) -> None:
    store = MetadataStore(tmp_path / "data")
    store.models.ensure_base("base")
    data = "\n".join(json.dumps(row) for row in ROWS).encode()
    file = store.files.create("acme", "train.jsonl", "fine-tune", data)
    service = FineTuningService(store, TENANTS, ("base",), python_graders=python)
    body = FineTuningJobCreate.model_validate({"model": "base", "training_file": file.id, "method": _method(PYTHON)})
    if not python:
        with pytest.raises(ProtocolError, match="--enable-python-graders") as info:
            service.create("acme", body)
        assert (info.value.param, info.value.code) == (f"{GRADER_PARAM}.type", "invalid_grader")
        return
    job = service.create("acme", body)
    assert job.method is not None and job.method.reinforcement is not None
    assert job.method.reinforcement.grader == PYTHON
    label = {"type": "label_model", "name": "j", "model": "base", "input": JUDGE, "labels": ["y"],
             "passing_labels": ["y"]}
    judged = {"type": "multi", "name": "m", "calculate_output": "py + j", "graders": {"py": PYTHON, "j": label}}
    with pytest.raises(ProtocolError, match="label_model") as info:  # python on: label_model stays refused
        service.create("acme", FineTuningJobCreate.model_validate({"model": "base", "training_file": file.id,
                                                                   "method": _method(judged)}))
    assert info.value.param == f"{GRADER_PARAM}.graders.j.type"
