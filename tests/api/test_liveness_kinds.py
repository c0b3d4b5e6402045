"""The liveness rule for every kind of job (the acceptance check's README asks it of DPO, reinforcement and
Tinker runs): on a server whose TPOT SLO no iteration meets, with clients chatting the whole time, the
hybrid share gives fine-tuning nothing, and a DPO job, a reinforcement job and a Tinker training run each
still finish, on fine-tuning's minimum share, through the real HTTP server and the official clients.

The tiny model stands in for a real one (`benchmarks/liveness_kinds.py` runs the same on SmolLM2 and
records it in RESULTS.md); a 64-token batch limit and a small KV cache make the rest hard too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_dpo_http import PAIRS
from test_reinforcement_jobs_http import EXACT, ROWS

from local_server import LocalServer, local_server, poll_job, upload_jsonl

KEY, TINKER_KEY = "sk-liveness-0123456789", "tml-liveness-0123456789"


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    # 0.05 ms: below any iteration, so the SLO never leaves fine-tuning room beside a running request.
    with local_server(llama_dir, tmp_path_factory.mktemp("liveness"), {"t": {"api_keys": [KEY, TINKER_KEY]}},
                      tpot_slo_ms=0.05, max_batch_tokens=64, kv_cache_memory_gb=0.03) as srv:
        yield srv


@contextmanager
def chatting(server: LocalServer, clients: int = 2) -> Iterator[list[int]]:
    """`clients` threads streaming chat replies back to back until the block ends; yields the number of
    replies finished so far (one counter per client)."""
    stop, done = threading.Event(), [0] * clients

    def chat(i: int) -> None:
        oa = server.client(KEY)
        while not stop.is_set():
            stream = oa.chat.completions.create(model=server.base, max_tokens=24, stream=True, temperature=0.0,
                                                messages=[{"role": "user", "content": f"Count to {i + 5}."}])
            for _ in stream:
                pass
            done[i] += 1

    threads = [threading.Thread(target=chat, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield done
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)


def _finishes_beside_chat(server: LocalServer, method: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    oa = server.client(KEY)
    training = upload_jsonl(oa, rows)
    with chatting(server) as done:
        job = oa.fine_tuning.jobs.create(model=server.base, training_file=training, seed=0,
                                         method=method)  # type: ignore[arg-type]
        job = poll_job(oa, job.id, timeout=600, interval=0.5)
        served = sum(done)
    assert job.status == "succeeded", job.error
    assert served >= 2, "the chat clients were not served while the job ran"


def test_a_dpo_job_finishes_beside_chat_under_an_slo_no_iteration_meets(server: LocalServer) -> None:
    _finishes_beside_chat(server, {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}},
                          PAIRS)


def test_a_reinforcement_job_finishes_beside_chat_under_an_slo_no_iteration_meets(server: LocalServer) -> None:
    method = {"type": "reinforcement", "reinforcement": {
        "grader": EXACT, "max_completion_tokens": 4,
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "compute_multiplier": 1}}}
    _finishes_beside_chat(server, method, ROWS)


def test_a_tinker_run_finishes_beside_chat_under_an_slo_no_iteration_meets(server: LocalServer) -> None:
    tinker = pytest.importorskip("tinker")
    from tinker import types

    tokens = [int(t) for t in np.random.default_rng(0).integers(10, 200, size=33)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
    service = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=TINKER_KEY)
    with chatting(server) as done:
        training = service.create_lora_training_client(base_model=server.base, rank=8).result(timeout=300)
        losses = []
        for _ in range(3):
            out = training.forward_backward([datum], "cross_entropy").result(timeout=300)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
            losses.append(-float(np.mean(out.loss_fn_outputs[0]["logprobs"].to_numpy())))
        saved = training.save_weights_for_sampler("liveness").result(timeout=300)
        sampler = service.create_sampling_client(model_path=saved.path).result(timeout=300)
        sample = sampler.sample(prompt=types.ModelInput.from_ints(tokens[:8]), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=300)
        served = sum(done)
    service.close("success").result(timeout=60)
    assert losses[-1] < losses[0], losses  # the steps were taken, not skipped
    assert len(sample.sequences[0].tokens) == 4
    assert served >= 2, "the chat clients were not served while the run trained"
