"""The serving path on real Ray: SchedulerActor and EngineActor as Ray actors, the gateway as a Ray Serve
ingress deployment, driven over HTTP by the official `openai` client. One cluster for the module
(starting Ray costs ~10 s here); the `--local` path has the detailed tests (tests/api/test_chat.py)."""

from __future__ import annotations

import importlib
import json
import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coserve import LLM, SamplingParams
from coserve.server.assembly import ENGINE_ACTOR, RAY_NAMESPACE, SCHEDULER_ACTOR
from deploy_config import local_args, serve_config
from local_server import ADMIN_KEY, scrape

pytestmark = pytest.mark.ray

KEY = "sk-ray-tenant-0123"
OTHER_KEY = "sk-ray-other-0123"
HELLO = [{"role": "user", "content": "Hello there"}]


@dataclass
class RayServer:
    url: str
    base: str
    scheduler: Any
    engine: Any
    data_dir: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    import ray
    from ray import serve

    root = tmp_path_factory.mktemp("ray-serving")
    tenants = root / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"ray-tenant": {"api_keys": [KEY]},
                                               "other": {"api_keys": [OTHER_KEY]}},
                               "admin_api_keys": [ADMIN_KEY]}))
    # deploy/serve.yaml's application, as `serve run` builds it, with this machine's paths and the CPU.
    (app,) = serve_config()["applications"]
    args = {**local_args(app["args"], llama_dir, tenants, root / "data"), "max_num_seqs": 8}
    builder = getattr(importlib.import_module(app["import_path"].split(":")[0]), app["import_path"].split(":")[1])
    port = _free_port()
    # 3 CPUs: the engine holds one (its placement group bundle), a dedicated run's two workers the others.
    ray.init(address="local", num_cpus=3, include_dashboard=False, namespace=RAY_NAMESPACE,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(builder(args), name=app["name"], route_prefix=app["route_prefix"])
        yield RayServer(url=f"http://127.0.0.1:{port}", base=llama_dir.name,
                        scheduler=ray.get_actor(SCHEDULER_ACTOR, namespace=RAY_NAMESPACE),
                        engine=ray.get_actor(ENGINE_ACTOR, namespace=RAY_NAMESPACE), data_dir=root / "data")
        serve.shutdown()
    finally:
        ray.shutdown()


def client(srv: RayServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def metric(srv: RayServer, name: str, **labels: str) -> float:
    for line in scrape(srv.url).splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


def test_chat_on_ray_matches_offline_and_streams(ray_server: RayServer, llama_dir: Path) -> None:
    oa = client(ray_server)
    out = oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=16, temperature=0)
    ref = LLM(model=str(llama_dir), dtype="float32").chat(HELLO, SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage
    two = oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=4, n=2, seed=5)
    assert [c.index for c in two.choices] == [0, 1]


def test_sampling_controls_cross_the_actors(ray_server: RayServer, llama_dir: Path) -> None:
    # The new SamplingParams fields travel gateway -> SchedulerActor -> EngineActor (plain dataclasses).
    oa = client(ray_server)
    forced = oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=4, temperature=0,
                                        logit_bias={"300": 100}, logprobs=True)
    assert [t.token for t in forced.choices[0].logprobs.content] == ["as"] * 4
    penalised = oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=24, temperature=0,
                                           frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5,
                                                                              "ignore_eos": True})
    params = SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0, repetition_penalty=1.5,
                            ignore_eos=True)
    ref = LLM(model=str(llama_dir), dtype="float32").chat(HELLO, params)[0]
    assert penalised.choices[0].message.content == ref.outputs[0].text
    with pytest.raises(openai.BadRequestError) as info:  # refused by the scheduler actor's admission
        oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=2, logit_bias={"99999": 1})
    assert info.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:  # deploy/serve.yaml's max_n: 16
        oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=1, n=17)
    assert info.value.param == "n"


def test_concurrent_streams_on_ray(ray_server: RayServer) -> None:
    """Many live streams share one poll per iteration; requests that arrive while the pump runs get
    every batch (the gateway registers them before submitting)."""
    oa = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key=KEY, max_retries=0, timeout=20)
    prompts = [[{"role": "user", "content": f"Story number {i}"}] for i in range(6)]
    expected = [oa.chat.completions.create(model=ray_server.base, messages=p, max_tokens=24, temperature=0)
                .choices[0].message.content for p in prompts]

    def streamed(messages: list[dict]) -> str:
        chunks = oa.chat.completions.create(model=ray_server.base, messages=messages, max_tokens=24,
                                            temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(max_workers=6) as pool:
        background = pool.submit(oa.chat.completions.create, model=ray_server.base, messages=HELLO,
                                 max_tokens=300, extra_body={"ignore_eos": True})
        texts = list(pool.map(streamed, prompts))
        assert background.result().usage.completion_tokens == 300
    assert texts == expected



def test_the_gateway_does_not_queue_streams_in_serve(ray_server: RayServer) -> None:
    """As many concurrent streams as the scheduler runs at once (max_num_seqs 8) all get their first token
    before any of them ends: Serve's default of 5 ongoing requests per replica would hold the rest in its
    proxy until earlier ones finish."""
    oa = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def stream(i: int) -> tuple[float, float]:
        chunks = oa.chat.completions.create(model=ray_server.base, max_tokens=64, stream=True,
                                            messages=[{"role": "user", "content": f"Stream {i}"}],
                                            extra_body={"ignore_eos": True})
        first = None
        for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic()
        assert first is not None
        return first, time.monotonic()

    with ThreadPoolExecutor(max_workers=8) as pool:
        spans = list(pool.map(stream, range(8)))
    assert max(first for first, _ in spans) < min(end for _, end in spans)

def test_errors_on_ray(ray_server: RayServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(ray_server).chat.completions.create(model="ft:nope", messages=HELLO)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client(ray_server).chat.completions.create(model=ray_server.base, messages=HELLO, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client(ray_server).chat.completions.create(model=ray_server.base,
                                                   messages=[{"role": "user", "content": "word " * 3000}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        client(ray_server, "sk-nobody-000000").models.list()


def test_disconnect_aborts_on_ray(ray_server: RayServer) -> None:
    body = {"model": ray_server.base, "messages": HELLO, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{ray_server.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {OTHER_KEY}"}) as response:
        assert next(response.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 30
    while metric(ray_server, "coserve_requests_total", tenant="other", outcome="abort") < 1:
        assert time.monotonic() < deadline, ("the disconnected stream was not aborted: " + "; ".join(
            line for line in scrape(ray_server.url).splitlines()
            if 'tenant="other"' in line and not line.startswith("#")))
        time.sleep(0.1)
    assert metric(ray_server, "coserve_tokens_total", kind="completion", tenant="other") < 1900


def test_health_metrics_and_engine_loop_on_ray(ray_server: RayServer) -> None:
    import ray

    assert httpx.get(f"{ray_server.url}/health").json() == {"status": "ok"}
    assert metric(ray_server, "coserve_tokens_total", kind="completion", tenant="ray-tenant") > 0
    assert metric(ray_server, "coserve_time_to_first_token_seconds_count", tenant="ray-tenant") >= 1
    stats = ray.get(ray_server.engine.stats.remote())
    assert stats["iterations"] > 0 and stats["failures"] == 0


def test_stop_strings_on_ray_and_no_torch_in_the_gateway_or_the_scheduler(ray_server: RayServer,
                                                                           llama_dir: Path) -> None:
    """The gateway replica detokenizes and watches the stop strings, the scheduler actor sees token ids
    and stops a choice when told: a stop string cuts the reply as offline. Neither process has imported
    torch, after all the serving above; the engine's process has."""
    import ray

    llm = LLM(model=str(llama_dir), dtype="float32")
    free = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    ref = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    out = client(ray_server).chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=24,
                                                     temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == ref.text == free[:free.index(stop)]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == len(ref.token_ids) < 24

    def torch_loaded(_actor: object) -> bool:
        import sys

        return "torch" in sys.modules

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert replicas
    for replica in replicas:
        assert not ray.get(ray.get_actor(replica["name"], namespace=replica["namespace"])
                           .__ray_call__.remote(torch_loaded))
    assert not ray.get(ray_server.scheduler.__ray_call__.remote(torch_loaded))
    assert ray.get(ray_server.engine.__ray_call__.remote(torch_loaded))


def _stream_outcome(srv: RayServer) -> str:
    """One long stream: "done" when it finished, else the error it ended with."""
    body = {"model": srv.base, "messages": HELLO, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: ") and '"error"' in line:
                event = json.loads(line[6:])
                if "error" in event:  # an error event, not a chunk that merely mentions the word
                    return event["error"]["message"]
    return "closed without [DONE]"


@pytest.mark.slow  # a Ray Train run of its own: 40 s here
def test_dedicated_job_trains_on_ray_train_and_its_model_answers(ray_server: RayServer) -> None:
    """A job asking for a dedicated run trains as a Ray Train TorchTrainer of 2 CPU workers (gloo), outside
    the engine: the same events (metrics per step, checkpoints, status), checkpoints that are servable models,
    and the fine-tuned model answering through the engine the moment the job succeeds. More workers than the
    cluster has room for (3 CPUs, one the engine's) is a 400 at creation naming `training.workers` and the cluster."""
    from local_server import poll_job, upload_jsonl

    oa = client(ray_server)
    lines = [{"messages": [{"role": "user", "content": f"Code for {i}?"},
                           {"role": "assistant", "content": f"The code for {i} is {i * 7}."}]} for i in range(12)]
    file_id = upload_jsonl(oa, lines)
    with pytest.raises(openai.BadRequestError) as info:
        oa.fine_tuning.jobs.create(model=ray_server.base, training_file=file_id,
                                   extra_body={"training": {"mode": "dedicated", "workers": 3}})
    assert info.value.param == "training.workers" and info.value.code == "insufficient_cluster_capacity"
    assert ("at most 2 worker(s) of {'CPU': 1.0} (the cluster has {'CPU': 3.0}), less {'CPU': 1.0} the serving "
            "actors hold") in info.value.message
    job = oa.fine_tuning.jobs.create(model=ray_server.base, training_file=file_id, suffix="ded",
                                     hyperparameters={"n_epochs": 2, "batch_size": 4},
                                     extra_body={"training": {"mode": "dedicated", "workers": 2}})
    assert job.model_extra["training"] == {"mode": "dedicated", "workers": 2}
    done = poll_job(oa, job.id, timeout=300, interval=0.5)
    assert done.status == "succeeded", (done.error, [e.message for e in oa.fine_tuning.jobs.list_events(job.id).data])

    events = oa.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]  # oldest first
    messages = [e.message for e in events]
    assert any(m.startswith("Training on Ray Train: a TorchTrainer of 2 worker(s)") for m in messages), messages
    assert any(m.startswith("Ray Train started 2 worker(s) (gloo)") for m in messages), messages
    metrics = [e.data for e in events if e.type == "metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and all(m["total_steps"] == 6 for m in metrics)
    assert all(m["train_loss"] > 0 for m in metrics)
    checkpoints = oa.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [6, 3]
    assert messages[-1] == "The job has successfully completed" and done.trained_tokens > 0
    # Servable at once, through the engine: the fine-tuned model and a checkpoint.
    for model in (done.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        reply = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Code for 3?"}],
                                           max_tokens=8, temperature=0)
        assert reply.model == model and reply.choices[0].message.content
    assert (ray_server.data_dir / "adapters" / job.id / "run-1" / "ckpt-step-3" / "optimizer.pt").is_file()

    # Cancelled while its workers train: they stop at the next step boundary and the job says so.
    long = oa.fine_tuning.jobs.create(model=ray_server.base, training_file=file_id,
                                      hyperparameters={"n_epochs": 50, "batch_size": 1},
                                      extra_body={"training": {"mode": "dedicated"}})  # the default: 2
    poll_job(oa, long.id, lambda j: j.status in ("failed", "succeeded") or any(
        e.type == "metrics" for e in oa.fine_tuning.jobs.list_events(j.id, limit=100).data), timeout=300, interval=0.5)
    assert oa.fine_tuning.jobs.cancel(long.id).status == "cancelled"
    deadline = time.monotonic() + 120
    while "Fine-tuning job cancelled" not in [e.message for e in oa.fine_tuning.jobs.list_events(long.id).data]:
        assert time.monotonic() < deadline, [e.message for e in oa.fine_tuning.jobs.list_events(long.id).data]
        time.sleep(0.5)
    # The runs' Ray actors are gone once their jobs ended (their workers with them).
    while any(a["name"].startswith("coserve-dedicated-") for a in ray_list_named_actors()):
        assert time.monotonic() < deadline, ray_list_named_actors()
        time.sleep(0.5)


def test_a_reinforcement_job_runs_its_rollout_loop_in_the_scheduler_actor(ray_server: RayServer) -> None:
    """On Ray the rollout loop lives in the scheduler actor's process: rollouts are requests on the engine
    actor, graders run on the actor's thread pool, and a `score_model` judge is a request the actor submits
    to itself as the tenant; the job succeeds with its rewards in its events and its model answers."""
    from local_server import poll_job, upload_jsonl

    oa = client(ray_server)
    rows = [{"messages": [{"role": "user", "content": f"Count to {i % 4 + 1}."}],
             "answer": " ".join(str(k) for k in range(1, i % 4 + 2))} for i in range(10)]
    judge = {"type": "score_model", "name": "judge", "model": ray_server.base, "range": [-1e6, 1e6],
             "input": [{"role": "user", "content": "Score {{ sample.output_text }} against {{ item.answer }}."}],
             "sampling_params": {"temperature": 0, "max_completions_tokens": 24}}
    grader = {"type": "multi", "name": "mix", "calculate_output": "close + 0 * judge", "graders": {
        "close": {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
                  "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}, "judge": judge}}
    job = oa.fine_tuning.jobs.create(model=ray_server.base, training_file=upload_jsonl(oa, rows),
                                     validation_file=upload_jsonl(oa, rows[:2]),
                                     method={"type": "reinforcement", "reinforcement": {  # type: ignore[typeddict-item]
                                         "grader": grader, "max_completion_tokens": 6,
                                         "hyperparameters": {"n_epochs": 1, "batch_size": 5}}})
    done = poll_job(oa, job.id, timeout=240, interval=0.5)
    assert done.status == "succeeded", (done.error, [e.message for e in oa.fine_tuning.jobs.list_events(job.id).data])
    metrics = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert sorted(m["step"] for m in metrics if "train_reward_mean" in m) == [1, 2]
    assert all("train_reward/judge" in m for m in metrics if "train_reward_mean" in m)
    assert sorted(m["step"] for m in metrics if "valid_reward_mean" in m) == [0, 1, 2]
    reply = oa.chat.completions.create(model=done.fine_tuned_model or "", max_tokens=4,
                                       messages=[{"role": "user", "content": "Count to 2."}])
    assert reply.choices[0].message.content is not None


def ray_list_named_actors() -> list[dict[str, str]]:
    import ray

    return ray.util.list_named_actors(all_namespaces=True)


def test_killed_engine_comes_back_and_loses_no_job(ray_server: RayServer) -> None:
    """Last in this module: it kills the engine process. Running streams end with an error that says
    the engine stopped, the actor is restarted and serves again, the job resumes from its checkpoint."""
    import os
    import signal

    import ray

    from local_server import TERMINAL, poll_job, upload_jsonl

    oa = client(ray_server)
    lines = [{"messages": [{"role": "user", "content": f"Count {i}"},
                           {"role": "assistant", "content": f"{i} {i + 1} {i + 2}"}]} for i in range(16)]
    job = oa.fine_tuning.jobs.create(model=ray_server.base, training_file=upload_jsonl(oa, lines),
                                     hyperparameters={"n_epochs": 16, "batch_size": 4})  # < 100 events
    running = poll_job(oa, job.id, lambda j: j.status in TERMINAL or j.status == "running"
                       and bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=120, interval=0.2)
    assert running.status == "running", running  # killed below while it trains, with a checkpoint
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream_outcome, ray_server) for _ in range(4)]
        time.sleep(1.0)
        os.kill(ray.get(ray_server.engine.pid.remote()), signal.SIGKILL)
        outcomes = [s.result(timeout=120) for s in streams]
    # The kill must land while the job trains (6 epochs once finished within the second before it).
    assert oa.fine_tuning.jobs.retrieve(job.id).status == "running"
    assert any("engine stopped" in o for o in outcomes), outcomes
    assert all(o == "done" or "engine stopped" in o for o in outcomes), outcomes

    deadline = time.monotonic() + 120
    while httpx.get(f"{ray_server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{ray_server.url}/health").text
        time.sleep(0.5)
    reply = oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    done = poll_job(oa, job.id, timeout=180, interval=0.5)
    assert done.status == "succeeded", done
    events = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
    # It waited for an engine, then was placed on the restarted one, from its last checkpoint.
    assert any(e.startswith("Waiting for an engine") for e in events), events
    assert any(e.startswith("Placed on engine") and "resumed from" in e for e in events), events


def _data_dir_holder(srv: RayServer) -> int:
    """The pid that holds the server's data dir lock (another server would be refused, naming it)."""
    from coserve.actors.data_dir_lock import DataDirLock, DataDirLocked

    with pytest.raises(DataDirLocked) as refused:
        DataDirLock.acquire(srv.data_dir)
    match = re.match(r"pid (\d+) on host ", refused.value.holder)
    assert match, refused.value.holder
    return int(match.group(1))


def _scheduler_pid() -> int:
    """The pid of the live scheduler actor's process."""
    import os

    import ray

    scheduler = ray.get_actor(SCHEDULER_ACTOR, namespace=RAY_NAMESPACE)
    return int(ray.get(scheduler.__ray_call__.remote(lambda _: os.getpid())))


def test_the_scheduler_actor_holds_the_data_dir(ray_server: RayServer) -> None:
    # The lock lives with the jobs' owner, the scheduler actor's process: not the driver, not the replica.
    assert _data_dir_holder(ray_server) == _scheduler_pid()


def test_restarted_gateway_replica_resumes_jobs(ray_server: RayServer) -> None:
    """Last in this module: it kills the Serve replica that owns the actors. Serve starts a new one, which
    starts fresh actors; a job that was training resumes from its last checkpoint and succeeds."""
    import ray

    from local_server import TERMINAL, poll_job, upload_jsonl

    oa = client(ray_server)
    lines = [{"messages": [{"role": "user", "content": f"Spell {i}"},
                           {"role": "assistant", "content": f"{i}: {'-'.join(str(i))}"}]} for i in range(16)]
    job = oa.fine_tuning.jobs.create(model=ray_server.base, training_file=upload_jsonl(oa, lines),
                                     hyperparameters={"n_epochs": 16, "batch_size": 4})  # < 100 events
    running = poll_job(oa, job.id, lambda j: j.status in TERMINAL or j.status == "running"
                       and bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=120, interval=0.2)
    assert running.status == "running", running
    first_holder = _data_dir_holder(ray_server)
    (replica,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)

    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{ray_server.url}/health", timeout=5).status_code == 200:
                reply = oa.chat.completions.create(model=ray_server.base, messages=HELLO, max_tokens=4)
                break
        except (httpx.HTTPError, openai.APIError):
            pass
        assert time.monotonic() < deadline, "no replica answered in 180 s"
        time.sleep(0.5)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # The new replica's scheduler took the data dir over from the killed one's (the OS released its lock).
    assert _data_dir_holder(ray_server) == _scheduler_pid() != first_holder
    done = poll_job(oa, job.id, timeout=180, interval=0.5)
    assert done.status == "succeeded", done
    events = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
    assert "Resumed from the last checkpoint" in events, events
