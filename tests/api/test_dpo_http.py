"""`method: dpo` through the real server (`--local`, the tiny llama), driven by the official `openai`
client: preference files, the job's echo of its method and beta, DPO's metrics in events and
checkpoints, validation metrics, a tuned model that serves at once, and the bad input the DPO issue
lists, each a 400 naming the param or the line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from local_server import LocalServer, local_server, poll_job, upload_jsonl

KEY = "sk-dpo-tenant-0123456789"


def _pair(i: int) -> dict[str, Any]:
    return {"input": {"messages": [{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": f"What is {i} plus {i}?"}]},
            "preferred_output": [{"role": "assistant", "content": f"{2 * i}."}],
            "non_preferred_output": [{"role": "assistant",
                                      "content": f"Well, let me think about {i} and {i} for a while."}]}


PAIRS = [_pair(i) for i in range(12)]
CHAT = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}"}]}
        for i in range(12)]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(llama_dir, tmp_path_factory.mktemp("dpo"), {"t": {"api_keys": [KEY]}}) as srv:
        yield srv


def _dpo(beta: Any = 0.2, **hyperparameters: Any) -> dict[str, Any]:
    return {"type": "dpo", "dpo": {"hyperparameters": {"beta": beta, **hyperparameters}}}


def test_a_dpo_job_trains_reports_rewards_and_serves(server: LocalServer) -> None:
    oa = server.client(KEY)
    training, validation = upload_jsonl(oa, PAIRS), upload_jsonl(oa, PAIRS[:3])
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=training,
                                     validation_file=validation, seed=3,
                                     method=_dpo(n_epochs=1, batch_size=4))  # type: ignore[arg-type]
    assert job.method is not None and job.method.type == "dpo"
    assert job.method.dpo is not None and job.method.dpo.hyperparameters.beta == 0.2
    job = poll_job(oa, job.id, timeout=120)
    assert job.status == "succeeded", job.error
    assert job.trained_tokens and job.fine_tuned_model
    assert job.hyperparameters.batch_size == 4 and job.method.dpo.hyperparameters.n_epochs == 1  # type: ignore[union-attr]
    events = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
    steps = [d for d in events if "valid_loss" not in d]
    assert len(steps) == 3  # 12 pairs, batch 4
    for data in steps:
        assert {"train_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected"} <= set(data)
        assert 0.0 <= data["rewards/accuracies"] <= 1.0
    validations = [d for d in events if "valid_loss" in d]
    assert validations and {"valid_rewards/accuracies", "valid_rewards/margins"} <= set(validations[0])
    checkpoints = list(oa.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and "rewards/accuracies" in checkpoints[0].metrics.model_dump()
    reply = oa.chat.completions.create(model=job.fine_tuned_model,
                                       messages=[{"role": "user", "content": "What is 2 plus 2?"}],
                                       max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize(("patch", "param", "words"), [
    ({"method": _dpo(), "training_file": "chat"}, "training_file", "holds chat rows"),
    ({"method": {"type": "supervised"}, "training_file": "pairs"}, "training_file", "holds preference rows"),
    ({"training_file": "pairs"}, "training_file", "holds preference rows"),  # no method: supervised
    ({"method": _dpo(beta=0)}, "method.dpo.hyperparameters.beta", ""),
    ({"method": _dpo(beta=10.5)}, "method.dpo.hyperparameters.beta", ""),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}},
     "method.supervised.hyperparameters.beta", ""),
    ({"method": {"type": "ppo"}}, "method.type", ""),
    ({"method": _dpo(), "validation_file": "chat"}, "validation_file", "holds chat rows"),
])
def test_bad_dpo_requests_are_400s_naming_the_param(server: LocalServer, patch: dict[str, Any],
                                                    param: str, words: str) -> None:
    oa = server.client(KEY)
    files = {"pairs": upload_jsonl(oa, PAIRS), "chat": upload_jsonl(oa, CHAT)}
    body: dict[str, Any] = {"model": server.base, "training_file": files["pairs"]}
    for key, value in patch.items():
        body[key] = files.get(value, value) if isinstance(value, str) else value
    with pytest.raises(openai.BadRequestError) as info:
        oa.fine_tuning.jobs.create(**body)
    error = info.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
    assert words in error["message"]


def test_a_bad_preference_row_is_refused_at_upload_naming_its_line(server: LocalServer) -> None:
    oa = server.client(KEY)
    same = {**_pair(1), "non_preferred_output": _pair(1)["preferred_output"]}
    with pytest.raises(openai.BadRequestError, match="Line 2: 'preferred_output' and 'non_preferred_output' "
                                                     "are the same answer"):
        upload_jsonl(oa, [_pair(0), same])
    not_user = {**_pair(2), "input": {"messages": [{"role": "assistant", "content": "hi"}]}}
    with pytest.raises(openai.BadRequestError, match="must end with a user message"):
        upload_jsonl(oa, [not_user])
