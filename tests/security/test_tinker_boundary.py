"""The tenant boundary on the Tinker API (issue 45): an ATTACKER tenant tries each case against a real
server (`coserve serve --local` on the tiny llama, in a thread), with the official `tinker` SDK where it
can send the case and raw HTTP where the body is malformed on purpose; a VICTIM tenant trains through
Tinker and chats (also with its own fine-tuned weights) meanwhile. Each case: the attacker gets a 4xx
naming what is wrong, the victim's calls and chat finish with no error, `/health` answers within 1 s
throughout, and the server's memory stays bounded."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import psutil
import pytest
import zstandard

from local_server import LocalServer, local_server, upload_jsonl

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

ATTACKER, VICTIM = "tml-attacker-0123456789", "tml-victim-0123456789"
VICTIM_OPENAI = "sk-victim-0123456789"
FLOOD = "tml-flood-0123456789"  # a tenant with a small Tinker rate (6 calls a minute)
HOARDER = "tml-hoarder-0123456789"  # a tenant with little storage (150 kB: two saves of rank 4)
HOG = "tml-hog-0123456789"  # a tenant with the default limits: 8 runs, against the engine's 4 adapter slots
CHAT_BOUND_S = 20.0  # the victim's chat with its own fine-tuned weights (it timed out at 45-60 s before)
TOKENS = list(range(5, 37))
HEALTH_BOUND_S = 1.0
RSS_BOUND_MB = 400  # growth of the server's process (the test's too: one process) over a case
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinker-boundary")


@pytest.fixture(scope="module")
def vocab(llama_dir: Path) -> int:
    return int(json.loads((llama_dir / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def server(llama_dir: Path, root: Path) -> Iterator[LocalServer]:
    tenants = {"attacker": {"api_keys": [ATTACKER], "limits": {"max_concurrent_jobs": 2,
                                                              "max_training_tokens_per_job": 400}},
               "victim": {"api_keys": [VICTIM, VICTIM_OPENAI]},
               "flood": {"api_keys": [FLOOD], "limits": {"tinker_requests_per_minute": 6}},
               "hoarder": {"api_keys": [HOARDER], "limits": {"max_stored_bytes": 150_000}},
               "hog": {"api_keys": [HOG]}}
    with local_server(llama_dir, root, tenants) as srv:
        yield srv


@contextmanager
def service(server: LocalServer, key: str) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=key)
    try:
        yield client
    finally:
        client.close("success").result()


def datum(inputs: list[int], targets: list[int]) -> Any:
    return types.Datum(model_input=types.ModelInput.from_ints(inputs),
                       loss_fn_inputs={"target_tokens": np.asarray(targets, np.int64),
                                       "weights": np.ones(len(targets), np.float32)})


def shifted(tokens: list[int]) -> Any:
    """A datum the way tinker-cookbook builds one from a sequence."""
    return datum(tokens[:-1], tokens[1:])


class Watch:
    """`/health` polled every 50 ms in a thread (its slowest answer), and the process's peak RSS."""

    def __init__(self, url: str) -> None:
        self._url, self._stop = url, threading.Event()
        self.slowest, self.failures, self.polls = 0.0, [], 0
        self._process = psutil.Process()
        self.rss_start = self.rss_peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(0.05):
                started = time.perf_counter()
                try:
                    status = http.get(f"{self._url}/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.polls += 1
                self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)
                if status != 200:
                    self.failures.append(status)

    def check(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.polls > 0 and not self.failures, self.failures
        assert self.slowest < HEALTH_BOUND_S, f"/health took {self.slowest:.2f} s"
        grew = (self.rss_peak - self.rss_start) / 2**20
        assert grew < RSS_BOUND_MB, f"the server's process grew {grew:.0f} MB"


@contextmanager
def watched(server: LocalServer) -> Iterator[Watch]:
    watch = Watch(server.url)
    yield watch
    watch.check()


def victim_works(server: LocalServer, sc: Any, tc: Any, sampler_model: str | None = None) -> None:
    """The victim trains a step, samples, and chats (with its own fine-tuned weights when given): no error."""
    out = tc.forward_backward([shifted(TOKENS)], "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 1
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = sc.create_sampling_client(base_model=server.base)
    sample = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=3)).result()
    assert len(sample.sequences[0].tokens) == 3
    chat = server.client(VICTIM_OPENAI)
    for model in (server.base, sampler_model):
        if model is not None:
            reply = chat.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
            assert reply.choices[0].text is not None


@pytest.fixture(scope="module")
def victim(server: LocalServer) -> Iterator[tuple[Any, Any]]:
    with service(server, VICTIM) as sc:
        yield sc, sc.create_lora_training_client(base_model=server.base, rank=4).result()


def raw_forward_backward(server: LocalServer, key: str, body: bytes, zstd: bool = False) -> httpx.Response:
    headers = {"X-API-Key": key, "content-type": "application/x-protobuf"}
    if zstd:
        headers["content-encoding"] = "zstd"
    return httpx.post(f"{server.url}/tinker/api/v1/forward_backward", headers=headers, content=body, timeout=60)


def proto_body(run_id: str, data: list[Any], forward_only: bool = False) -> Any:
    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id=run_id, seq_id=1)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message


def test_out_of_vocabulary_token_ids_are_a_400_before_the_engine(server: LocalServer, victim: tuple[Any, Any],
                                                                  vocab: int) -> None:
    """The issue's ~100-byte request: ids past the vocabulary in forward_backward and forward (model_input
    and target_tokens), in a sample's prompt and stop ids, and in a completions prompt of ids."""
    sc, tc = victim
    with watched(server), service(server, ATTACKER) as attacker:
        run = attacker.create_lora_training_client(base_model=server.base, rank=4).result()
        for bad in (shifted([5, vocab + 7, 6]), datum([5, 6], [6, 10**9]), shifted([5, -3, 6])):
            with pytest.raises(tinker.BadRequestError, match="vocabulary"):
                run.forward_backward([bad], "cross_entropy").result()
            with pytest.raises(tinker.BadRequestError, match="vocabulary"):
                run.forward([bad], "cross_entropy").result()
            victim_works(server, sc, tc)
        sampler = attacker.create_sampling_client(base_model=server.base)
        for prompt, stop in (([5, vocab], None), ([5, 6], [vocab + 1])):
            with pytest.raises(tinker.BadRequestError):
                sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=2, stop=stop)).result()
        completion = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {ATTACKER}"},
                                json={"model": server.base, "prompt": [5, vocab + 3], "max_tokens": 2})
        assert completion.status_code == 400 and completion.json()["error"]["param"] == "prompt"
        run.forward_backward([shifted(TOKENS)], "cross_entropy").result()  # the attacker's run is not wedged
        victim_works(server, sc, tc)


def test_a_zstd_bomb_is_a_413_at_the_cap(server: LocalServer, victim: tuple[Any, Any]) -> None:
    """32 KB declaring 1 GiB of content: python-zstandard's one-shot decompress would allocate it all."""
    sc, tc = victim
    stream = zstandard.ZstdCompressor(level=3).compressobj(size=2**30)
    zeros = bytes(2**24)
    bomb = b"".join(stream.compress(zeros) for _ in range(64)) + stream.flush()
    assert len(bomb) < 64 * 2**10
    with watched(server):
        for _ in range(5):
            answer = raw_forward_backward(server, ATTACKER, bomb, zstd=True)
            assert answer.status_code == 413, answer.text
            assert answer.json()["error"]["code"] == "request_too_large"
        victim_works(server, sc, tc)


def csr_body(run_id: str, shape: list[int], rows: int) -> bytes:
    """A forward_backward whose weights are a CSR tensor of `shape` with `rows` row pointers."""
    message = proto_body(run_id, [shifted(TOKENS)])
    weights = message.data[0].loss_fn_inputs["weights"]
    weights.ClearField("dense")
    del weights.shape[:]
    weights.shape.extend(shape)
    weights.sparse_csr.values = b""
    weights.sparse_csr.crow_indices = np.zeros(rows, np.int64).tobytes()
    weights.sparse_csr.col_indices = b""
    return bytes(message.SerializeToString())


def test_sparse_shapes_are_bounded_before_allocation(server: LocalServer, victim: tuple[Any, Any]) -> None:
    """A CSR `shape` of 2^40 rows (a 500 before) and the issue's row loop (4 s of a frozen event loop from
    635 bytes): each a 400, while /health stays under 1 s and the victim trains and chats."""
    sc, tc = victim
    with service(server, ATTACKER) as attacker:
        run_id = attacker.create_lora_training_client(base_model=server.base, rank=4).result().model_id
        bodies = [csr_body(run_id, [2**40, 1], 2), csr_body(run_id, [10**7, 1], 2),  # the 635 bytes
                  csr_body(run_id, [2**20, 2**20], 2**18), csr_body(run_id, [len(TOKENS) - 1, 1], 2**18)]
        with watched(server):
            stop = threading.Event()
            statuses: list[int] = []

            def attack() -> None:
                with httpx.Client(timeout=60) as http:
                    while not stop.is_set():
                        for body in bodies:
                            statuses.append(http.post(
                                f"{server.url}/tinker/api/v1/forward_backward", content=body,
                                headers={"X-API-Key": ATTACKER, "content-type": "application/x-protobuf"}).status_code)

            threads = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
            for thread in threads:
                thread.start()
            try:
                victim_works(server, sc, tc)
                time.sleep(1.0)
            finally:
                stop.set()
                for thread in threads:
                    thread.join()
        assert statuses and set(statuses) == {400}, sorted(set(statuses))
        answer = raw_forward_backward(server, ATTACKER, bodies[0])
        assert answer.json()["error"]["param"] == "data[0].loss_fn_inputs.weights"


def test_runs_count_as_jobs_and_forward_tokens_are_metered(server: LocalServer) -> None:
    """max_concurrent_jobs 2: a third run is a 403; max_training_tokens_per_job 400: forward calls count."""
    with service(server, ATTACKER) as attacker:
        runs = [attacker.create_lora_training_client(base_model=server.base, rank=2).result() for _ in range(2)]
        with pytest.raises(tinker.APIStatusError, match="max_concurrent_jobs|at once") as refused:
            attacker.create_lora_training_client(base_model=server.base, rank=2).result()
        assert refused.value.status_code == 403
        oa = server.client(ATTACKER)  # and a fine-tuning job counts the open runs too
        rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
                for i in range(10)]
        with pytest.raises(openai.RateLimitError, match="max_concurrent_jobs"):
            oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, rows))
        done = 0
        with pytest.raises(tinker.APIStatusError, match="max_training_tokens_per_job"):
            while True:
                runs[0].forward([shifted(TOKENS)], "cross_entropy").result()  # 31 tokens each, forward only
                done += 31
                assert done <= 400
        assert done > 300


def test_the_storage_quota_holds_at_save_time_and_deleting_frees_it(server: LocalServer, root: Path) -> None:
    """Saves whose futures are never read are checked when written (they escaped the quota before), a
    name ending in a newline is a 400, and RestClient.delete_checkpoint frees room for a new save."""
    api, headers = f"{server.url}/tinker/api/v1", {"X-API-Key": HOARDER}
    with service(server, HOARDER) as hoarder:
        run = hoarder.create_lora_training_client(base_model=server.base, rank=4).result()
        run_dir = root / "data" / "runs" / run.model_id / "sampler_weights"

        def save(name: str) -> httpx.Response:
            return httpx.post(f"{api}/save_weights_for_sampler", headers=headers,
                              json={"model_id": run.model_id, "path": name})

        for name in ("x\n", "x\n\n", "../x", "x/y"):
            refused = save(name)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_name", refused.text
        # Three saves of ~68 kB (rank 4) against 150 kB, their futures never read: two are kept.
        assert all(save(name).status_code == 200 for name in ("a", "b", "c"))
        run.forward([shifted(TOKENS)], "cross_entropy").result()  # after the saves: they are done
        kept = sorted(p.name for p in run_dir.iterdir())
        assert kept == ["a", "b"], kept
        assert sum(f.stat().st_size for f in run_dir.parent.rglob("*") if f.is_file()) <= 150_000
        with pytest.raises(tinker.RequestFailedError, match="max_stored_bytes"):  # written, then removed
            run.save_weights_for_sampler("d").result()
        assert sorted(p.name for p in run_dir.iterdir()) == ["a", "b"]
        hoarder.create_rest_client().delete_checkpoint(run.model_id, "sampler_weights/a").result()
        assert not (run_dir / "a").exists()
        assert run.save_weights_for_sampler("e").result().path.endswith("/e")
        model = "tinker:" + run.model_id + ":b"
        assert server.client(HOARDER).completions.create(model=model, prompt="hi", max_tokens=2).choices
        hoarder.create_rest_client().delete_checkpoint(run.model_id, "sampler_weights/b").result()
        with pytest.raises(Exception, match="does not exist|not found|model_not_found"):
            server.client(HOARDER).completions.create(model=model, prompt="hi", max_tokens=2)


def test_every_tinker_endpoint_is_rate_limited_per_tenant(server: LocalServer, victim: tuple[Any, Any]) -> None:
    """The flood tenant (6 calls a minute) gets 429s with Retry-After on session creation, telemetry and
    heartbeats; the victim's calls go on. Telemetry bodies are capped."""
    sc, tc = victim
    api, headers = f"{server.url}/tinker/api/v1", {"X-API-Key": FLOOD}
    with watched(server):
        session = {"tags": [], "sdk_version": "x"}
        statuses = [httpx.post(f"{api}/create_session", headers=headers, json=session).status_code for _ in range(8)]
        statuses += [httpx.post(f"{api}/telemetry", headers=headers, json={
            "events": [], "platform": "x", "sdk_version": "x", "session_id": "s", "process_uuid": "p"}).status_code]
        assert statuses[-1] == 429 and 429 in statuses[:8], statuses
        limited = httpx.post(f"{api}/create_sampling_session", headers=headers, json={"session_id": "s"})
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        victim_works(server, sc, tc)
    victim_headers = {"X-API-Key": VICTIM}
    big = httpx.post(f"{api}/telemetry", headers=victim_headers, content=b"{" + b" " * 2**21 + b"}")
    assert big.status_code == 413
    many = httpx.post(f"{api}/telemetry", headers=victim_headers, json={
        "events": [{}] * 101, "platform": "x", "sdk_version": "x", "session_id": "s", "process_uuid": "p"})
    assert many.status_code == 400 and "events" in many.text



def timed_chat(server: LocalServer, model: str) -> float:
    started = time.monotonic()
    reply = server.client(VICTIM_OPENAI).completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
    assert reply.choices[0].text is not None
    return time.monotonic() - started


def test_more_runs_than_slots_leave_the_victim_its_fine_tuned_chat(server: LocalServer,
                                                                   victim: tuple[Any, Any]) -> None:
    """The issue's case: one tenant's 8 runs against the engine's 4 adapter slots, heartbeating idle, then
    all doing calls at once. The victim's chat with its own fine-tuned weights finishes within 20 s each
    time (it timed out before), and its own run and a new one train meanwhile."""
    sc, tc = victim
    tc.forward_backward([shifted(TOKENS)], "cross_entropy").result()
    saved = tc.save_weights_for_sampler("mine").result().path
    model = "tinker:" + saved.removeprefix("tinker://").replace("/sampler_weights/", ":")
    with service(server, HOG) as hog, watched(server):
        runs = [hog.create_lora_training_client(base_model=server.base, rank=4).result() for _ in range(8)]
        for run in runs:  # each takes a slot for its call, then holds none while it heartbeats
            run.forward_backward([shifted(TOKENS)], "cross_entropy").result()
        assert timed_chat(server, model) < CHAT_BOUND_S
        stop, errors = threading.Event(), []

        def busy(run: Any) -> None:
            try:
                while not stop.is_set():
                    run.forward_backward([shifted(TOKENS)], "cross_entropy").result()
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=busy, args=(run,), daemon=True) for run in runs]
        for thread in threads:
            thread.start()
        try:
            times = [timed_chat(server, model) for _ in range(3)]
            victim_works(server, sc, tc, model)
            fresh = sc.create_lora_training_client(base_model=server.base, rank=4).result()
            fresh.forward_backward([shifted(TOKENS)], "cross_entropy").result()
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert max(times) < CHAT_BOUND_S, times
        assert not errors, errors
