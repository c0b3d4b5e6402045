"""Test helpers: `coserve serve --local`'s app (uvicorn in a thread) with the tenants a test needs, and
polling a fine-tuning job through the official client."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from openai.types.fine_tuning import FineTuningJob
from uvicorn_thread import serve_in_thread

from coserve.serve import ServeOptions, build_local_app

TERMINAL = ("succeeded", "failed", "cancelled")


def local_app(model: Path, root: Path, tenants: dict[str, Any], **options: Any) -> tuple[Any, ServeOptions]:
    """The app and its options: tenants file and data dir under `root`, float32, small batch limits
    (8 sequences, 256 tokens) unless `options` say otherwise."""
    path = root / "tenants.yaml"
    path.write_text(json.dumps({"tenants": tenants}))
    settings = {"dtype": "float32", "max_num_seqs": 8, "max_batch_tokens": 256, **options}
    opts = ServeOptions(model=str(model), tenants=str(path), data_dir=str(root / "data"), local=True, **settings)
    opts.validate()
    return build_local_app(opts), opts


@contextmanager
def local_server(model: Path, root: Path, tenants: dict[str, Any], **options: Any) -> Iterator[str]:
    """Serve `local_app(...)`; yields its base URL (`http://127.0.0.1:PORT`)."""
    app, _ = local_app(model, root, tenants, **options)
    with serve_in_thread(app) as url:
        yield url


def poll_job(oa: openai.OpenAI, job_id: str, done: Callable[[FineTuningJob], bool] = lambda j: j.status in TERMINAL,
             timeout: float = 60.0, interval: float = 0.05) -> FineTuningJob:
    """Retrieve the job until `done(job)` (default: a final status); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    job = oa.fine_tuning.jobs.retrieve(job_id)
    while not done(job):
        assert time.monotonic() < deadline, f"job {job_id} did not get there in {timeout} s: {job.status}"
        time.sleep(interval)
        job = oa.fine_tuning.jobs.retrieve(job_id)
    return job


def upload_jsonl(oa: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    """Upload `lines` as a fine-tuning JSONL file; returns its id."""
    data = "\n".join(json.dumps(line) for line in lines).encode()
    return oa.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune").id
