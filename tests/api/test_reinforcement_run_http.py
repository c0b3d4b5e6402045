"""`method: reinforcement` running inside the real server (`--local`, the tiny llama), driven by the official
`openai` client: the scheduler samples each batch's rollouts from the adapter being trained, grades them off
its loop, trains them, evaluates the validation file at step 0, every `eval_interval` steps and at the end,
and reports rewards in step events, validation events and checkpoint metrics; a grader that fails on every
sample fails the job with its message; the tuned model serves at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from local_server import LocalServer, local_server, poll_job, upload_jsonl

KEY = "sk-rl-tenant-0123456789"


def _row(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Count to {i % 5 + 1}."}],
            "answer": " ".join(str(k) for k in range(1, i % 5 + 2)), "meta": {"id": i}}


ROWS = [_row(i) for i in range(10)]
FUZZY = {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}


def _method(grader: dict[str, Any], **hyperparameters: Any) -> dict[str, Any]:
    return {"type": "reinforcement",
            "reinforcement": {"grader": grader, "max_completion_tokens": 6,
                              "hyperparameters": {"n_epochs": 1, "batch_size": 5, **hyperparameters}}}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(llama_dir, tmp_path_factory.mktemp("rl"), {"t": {"api_keys": [KEY]}},
                      enable_python_graders=True) as srv:
        yield srv


def test_a_reinforcement_job_samples_grades_trains_evaluates_and_serves(server: LocalServer) -> None:
    oa = server.client(KEY)
    training, validation = upload_jsonl(oa, ROWS), upload_jsonl(oa, ROWS[:3])
    multi = {"type": "multi", "name": "both", "calculate_output": "0.5 * close + 0.5 * says",
             "graders": {"close": FUZZY,
                         "says": {"type": "python", "name": "says",
                                  "source": "def grade(sample, item):\n"
                                            "    return float(item['answer'][0] in sample['output_text'])\n"}}}
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=training, validation_file=validation,
                                     seed=2, method=_method(multi, eval_interval=1, compute_multiplier=0.75))  # type: ignore[arg-type]
    job = poll_job(oa, job.id, timeout=240)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model and job.trained_tokens
    events = list(oa.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = [e.data for e in events if e.type == "metrics"]
    steps = [d for d in metrics if "train_reward_mean" in d]
    assert sorted(d["step"] for d in steps) == [1, 2]  # 10 prompts, batch 5, one epoch
    for data in steps:
        assert 0.0 <= data["train_reward_mean"] <= 1.0 and data["train_grade_errors"] == 0.0
        assert {"train_reward/close", "train_reward/says", "train_loss"} <= set(data)
    evaluations = sorted(d["step"] for d in metrics if "valid_reward_mean" in d)
    assert evaluations == [0, 1, 2]  # the base, then every step (the last one is the final model)
    checkpoints = list(oa.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and checkpoints[0].metrics.model_dump().get("train_reward_mean") is not None
    reply = oa.chat.completions.create(model=job.fine_tuned_model, max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "Count to 3."}])
    assert reply.choices[0].message.content is not None


def test_a_score_model_judge_is_the_served_base_model_asked_as_the_tenant(server: LocalServer) -> None:
    oa = server.client(KEY)
    judge = {"type": "score_model", "name": "judge", "model": server.base, "range": [-1e6, 1e6],
             "input": [{"role": "user", "content": "Score {{ sample.output_text }} against {{ item.answer }}."}],
             "sampling_params": {"temperature": 0, "max_completions_tokens": 24}}
    grader = {"type": "multi", "name": "mix", "calculate_output": "close + 0 * judge",
              "graders": {"close": FUZZY, "judge": judge}}
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, ROWS),
                                     method=_method(grader, batch_size=10))  # type: ignore[arg-type]
    job = poll_job(oa, job.id, timeout=240)
    assert job.status == "succeeded", job.error
    (step,) = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=100)
               if e.type == "metrics" and "train_reward_mean" in e.data]
    # Every sample was judged (the tiny model's reply is held to {"result": "<number>"}), or scored 0 with
    # its reason: the judge sub-score is there, and the reward is the fuzzy score alone.
    assert "train_reward/judge" in step and step["train_grade_errors"] < 1.0
    assert step["train_reward_mean"] == pytest.approx(step["train_reward/close"], abs=1e-9) or \
        step["train_grade_errors"] > 0


def test_a_grader_that_fails_on_every_sample_fails_the_job_with_its_message(server: LocalServer) -> None:
    oa = server.client(KEY)
    broken = {"type": "python", "name": "broken",
              "source": "def grade(sample, item):\n    raise ValueError('no reward for ' + item['answer'])\n"}
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, ROWS),
                                     method=_method(broken))  # type: ignore[arg-type]
    job = poll_job(oa, job.id, timeout=120)
    assert job.status == "failed" and job.error is not None
    assert job.error.code == "grader_failed" and "no reward for" in job.error.message, job.error


def test_a_restarted_server_resumes_a_reinforcement_job_with_its_reward_history(llama_dir: Path,
                                                                                tmp_path: Path) -> None:
    tenants = {"t": {"api_keys": [KEY]}}
    with local_server(llama_dir, tmp_path, tenants) as first:
        oa = first.client(KEY)
        job = oa.fine_tuning.jobs.create(model=first.base, training_file=upload_jsonl(oa, ROWS), seed=4,
                                         method=_method(FUZZY, n_epochs=3))  # type: ignore[arg-type]
        # Past the first epoch's checkpoint (step 2) and into the next epoch, then the server goes away.
        poll_job(oa, job.id, lambda j: any("train_reward_mean" in e.data and e.data["step"] >= 3
                                           for e in oa.fine_tuning.jobs.list_events(j.id, limit=100)
                                           if e.type == "metrics"), timeout=120, interval=0.1)
        assert oa.fine_tuning.jobs.retrieve(job.id).status == "running"
    with local_server(llama_dir, tmp_path, tenants) as second:
        oa = second.client(KEY)
        done = poll_job(oa, job.id, timeout=240)
        assert done.status == "succeeded", done.error
        events = list(oa.fine_tuning.jobs.list_events(job.id, limit=100))
    assert any("Resumed from the last checkpoint" in e.message for e in events)
    steps = sorted(e.data["step"] for e in events if e.type == "metrics" and "train_reward_mean" in e.data)
    assert steps == [1, 2, 3, 4, 5, 6]  # each step's rewards once: those before the restart kept
