"""Several engines on real Ray: the engine actors pinned by a placement group, one CPU each here (one GPU
each with --device cuda), `--engines` refused above what the cluster holds, and a server of 2 CPU engines
under one scheduler (deploy/serve.yaml's application, `engines: 2`) driven by the official client: routing
uses both engines, an engine killed under load loses no job and no request silently, and a fine-tuned
model's requests stay on one engine."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coserve.contract.engine_config import EngineConfig
from coserve.server.assembly import SCHEDULER_ACTOR, app_builder
from coserve.server.engine_count import EnginesUnavailable, engine_room
from coserve.server.engine_pool import RAY_NAMESPACE, EnginePool, actor_name
from deploy_config import local_args, serve_config
from local_server import ADMIN_KEY, TERMINAL, free_port, poll_job, scrape, upload_jsonl

pytestmark = pytest.mark.ray

CLUSTER_CPUS = 3  # two engines (one CPU each) and room for the third test's refusal
KEY = "sk-engines-alpha-0123"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False, namespace=RAY_NAMESPACE,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_two_cpu_engines_are_created_and_placed_one_bundle_each(ray_cluster: None, llama_dir: Path) -> None:
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    pool = EnginePool.create(EngineConfig(model=str(llama_dir), dtype="float32"), 2)
    try:
        layouts = pool.layouts()
        assert list(layouts) == ["engine-0", "engine-1"]
        assert all(layout.num_kv_blocks > 0 for layout in layouts.values())
        table = placement_group_table(pool.group)
        assert table["state"] == "CREATED" and table["strategy"] == "PACK"
        assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        placements = [ray.get(handle.placement.remote()) for handle in pool.handles.values()]
        for placement in placements:
            assert placement["placement_group"] == pool.group.id.hex()
            assert placement["resources"] == {"CPU": 1.0} and placement["gpu_ids"] == []
        # The engines are the named actors the server finds and an operator kills, in separate processes.
        pids = {ray.get(ray.get_actor(actor_name(e), namespace=RAY_NAMESPACE).pid.remote()) for e in pool.handles}
        assert len(pids) == 2
        assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS - 2
    finally:
        for handle in pool.handles.values():
            ray.kill(handle)
        remove_placement_group(pool.group)
        _wait_names_free(list(pool.handles))


def _wait_names_free(engine_ids: list[str], timeout_s: float = 30.0) -> None:
    """Until the killed engines' actor names are free again (the server below takes the same names)."""
    import ray

    deadline = time.monotonic() + timeout_s
    for engine_id in engine_ids:
        while True:
            try:
                ray.get_actor(actor_name(engine_id), namespace=RAY_NAMESPACE)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"{actor_name(engine_id)} still registered"
            time.sleep(0.2)


def test_more_engines_than_the_cluster_holds_are_refused(ray_cluster: None, llama_dir: Path, tmp_path: Path) -> None:
    import ray

    room = engine_room("cpu")  # connected: the cluster's CPUs, not this machine's cores
    assert (room.resource, room.available, room.where) == ("CPU", CLUSTER_CPUS, "the Ray cluster")
    assert room.count(None) == 1 and room.count(CLUSTER_CPUS) == CLUSTER_CPUS
    with pytest.raises(EnginesUnavailable, match=rf"--engines 4: the Ray cluster has {CLUSTER_CPUS} CPU\(s\)"):
        room.count(4)
    with pytest.raises(EnginesUnavailable,
                       match=r"--engines 4: the Ray cluster has 0 GPU\(s\) and each engine takes one GPU"):
        engine_room("cuda").count(4)
    # A Serve config asking for more: refused when the application is built, counted on the cluster.
    (app,) = serve_config()["applications"]
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"alpha": {"api_keys": [KEY]}}}))
    with pytest.raises(EnginesUnavailable, match=rf"--engines 4: the Ray cluster has {CLUSTER_CPUS} CPU"):
        app_builder(local_args(app["args"], llama_dir, tenants, tmp_path / "data", engines=4))
    # Bundles the cluster cannot free in time: refused, and nothing is left reserved.
    with pytest.raises(EnginesUnavailable, match=r"did not free 4 x \{'CPU': 1.0\}"):
        EnginePool.create(EngineConfig(model=str(llama_dir), dtype="float32"), 4, timeout_s=1.0)
    assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS


# ------------------------------------------------------------------------ a server of two engines

@dataclass
class TwoEngines:
    url: str
    base: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def two_engines(ray_cluster: None, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoEngines]:
    from ray import serve

    root = tmp_path_factory.mktemp("two-engines")
    tenants = root / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"alpha": {"api_keys": [KEY]}}, "admin_api_keys": [ADMIN_KEY]}))
    (app,) = serve_config()["applications"]
    args = {**local_args(app["args"], llama_dir, tenants, root / "data", engines=2), "max_num_seqs": 4}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app_builder(args), name=app["name"], route_prefix=app["route_prefix"])
        yield TwoEngines(f"http://127.0.0.1:{port}", llama_dir.name)
    finally:
        serve.shutdown()


def _per_engine(srv: TwoEngines, name: str, **labels: str) -> dict[str, float]:
    """`name`'s samples with `labels`, by engine."""
    found: dict[str, float] = {}
    for line in scrape(srv.url).splitlines():
        match = re.fullmatch(rf"{name}{{(.*)}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            engine = re.search(r'engine="([^"]+)"', match.group(1))
            if engine:
                found[engine.group(1)] = found.get(engine.group(1), 0.0) + float(match.group(2))
    return found


def test_requests_are_routed_to_both_engines(two_engines: TwoEngines) -> None:
    import ray

    oa = two_engines.client()
    assert ray.get(ray.get_actor(SCHEDULER_ACTOR, namespace=RAY_NAMESPACE).engines.remote()) == ["engine-0",
                                                                                                 "engine-1"]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: oa.chat.completions.create(
            model=two_engines.base, messages=[{"role": "user", "content": f"Question {i}"}], max_tokens=24,
            extra_body={"ignore_eos": True}), range(8)))
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24 for r in replies)
    tokens = _per_engine(two_engines, "coserve_tokens_total", kind="completion", tenant="alpha")
    assert set(tokens) == {"engine-0", "engine-1"} and sum(tokens.values()) == 8 * 24, tokens
    iterations = _per_engine(two_engines, "coserve_engine_iterations_total")
    assert iterations["engine-0"] > 0 and iterations["engine-1"] > 0
    assert set(_per_engine(two_engines, "coserve_kv_blocks_total")) == {"engine-0", "engine-1"}


def _stream_outcome(srv: TwoEngines, index: int) -> str:
    """One long stream: "done" when it finished, else the error it ended with."""
    body = {"model": srv.base, "messages": [{"role": "user", "content": f"Story {index}"}], "max_tokens": 300,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=180,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.read().decode()}"
        for line in response.iter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: ") and '"error"' in line:
                event = json.loads(line[6:])
                if "error" in event:
                    return event["error"]["message"]
    return "closed without [DONE]"


def _job_engine(oa: openai.OpenAI, job_id: str) -> str | None:
    """The engine the job was last placed on, from its events."""
    for event in oa.fine_tuning.jobs.list_events(job_id, limit=100).data:  # newest first
        match = re.match(r"Placed on engine (engine-\d+)", event.message)
        if match:
            return match.group(1)
    return None


@pytest.fixture(scope="module")
def killed_engine(two_engines: TwoEngines) -> dict[str, Any]:
    """A job trains on one engine while streams run on both; that engine is killed (`ray.kill`, Ray
    restarts it). What happened to the job and to every stream."""
    import ray

    oa = two_engines.client()
    lines = [{"messages": [{"role": "user", "content": f"Count {i}"},
                           {"role": "assistant", "content": f"{i} {i + 1} {i + 2}"}]} for i in range(16)]
    job = oa.fine_tuning.jobs.create(model=two_engines.base, training_file=upload_jsonl(oa, lines),
                                     hyperparameters={"n_epochs": 12, "batch_size": 4})
    running = poll_job(oa, job.id, lambda j: j.status in TERMINAL or j.status == "running"
                       and bool(oa.fine_tuning.jobs.checkpoints.list(j.id).data), timeout=180, interval=0.2)
    assert running.status == "running", running  # killed below while it trains, with a checkpoint
    lost = _job_engine(oa, job.id)
    assert lost in ("engine-0", "engine-1")
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream_outcome, two_engines, i) for i in range(8)]
        time.sleep(1.5)
        ray.kill(ray.get_actor(actor_name(lost), namespace=RAY_NAMESPACE), no_restart=False)
        after = [pool.submit(lambda: oa.chat.completions.create(model=two_engines.base, messages=HELLO,
                                                                max_tokens=8)) for _ in range(4)]
        outcomes = [s.result(timeout=300) for s in streams]
        replies = [a.result(timeout=300) for a in after]
    status_at_kill = oa.fine_tuning.jobs.retrieve(job.id).status
    done = poll_job(oa, job.id, timeout=300, interval=0.5)
    scheduler = ray.get_actor(SCHEDULER_ACTOR, namespace=RAY_NAMESPACE)
    deadline = time.monotonic() + 120
    while sorted(ray.get(scheduler.engines.remote())) != ["engine-0", "engine-1"]:
        assert time.monotonic() < deadline, "the killed engine did not come back"
        time.sleep(0.5)
    events = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data]
    return {"lost": lost, "outcomes": outcomes, "replies": replies, "status_at_kill": status_at_kill,
            "job": done, "events": events}


def test_a_killed_engine_loses_no_job_and_no_request(two_engines: TwoEngines, killed_engine: dict[str, Any]) -> None:
    # Every stream completed (on the other engine, or started over there: no token of it was sent yet) or
    # ended with an error that says why; the requests sent after the kill were answered by the other.
    outcomes = killed_engine["outcomes"]
    assert all(o == "done" or "engine stopped" in o for o in outcomes), outcomes
    assert "done" in outcomes, outcomes
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in killed_engine["replies"])
    # The job resumed on the other engine from its last checkpoint, and finished.
    assert killed_engine["status_at_kill"] == "running"
    assert killed_engine["job"].status == "succeeded", killed_engine["job"]
    other = {"engine-0": "engine-1", "engine-1": "engine-0"}[killed_engine["lost"]]
    moved = [m for m in killed_engine["events"] if m.startswith(f"Placed on engine {other}, resumed from ")]
    assert moved and moved[0].endswith(f"(its engine {killed_engine['lost']} was lost)"), killed_engine["events"]
    # The restarted engine serves again.
    oa = two_engines.client()
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: oa.chat.completions.create(
            model=two_engines.base, messages=[{"role": "user", "content": f"Again {i}"}], max_tokens=8), range(4)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)


def test_a_fine_tuned_models_requests_stay_on_one_engine(two_engines: TwoEngines,
                                                         killed_engine: dict[str, Any]) -> None:
    oa = two_engines.client()
    model = killed_engine["job"].fine_tuned_model
    before = _per_engine(two_engines, "coserve_tokens_total", kind="completion", tenant="alpha")
    for i in range(6):
        reply = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count {i}"}],
                                           max_tokens=6, extra_body={"ignore_eos": True})
        assert reply.model == model and reply.usage.completion_tokens == 6
    after = _per_engine(two_engines, "coserve_tokens_total", kind="completion", tenant="alpha")
    grew = {e: after[e] - before.get(e, 0.0) for e in after if after[e] != before.get(e, 0.0)}
    assert len(grew) == 1 and sum(grew.values()) == 36, grew  # the engine that holds the adapter


def test_a_dpo_job_trains_on_ray_with_two_engines(two_engines: TwoEngines) -> None:
    """DPO where supervised jobs run: the scheduler actor on Ray places it on one of two engine actors;
    its reference passes, pairs and rewards are the same as on `--local`."""
    oa = two_engines.client()
    rows = [{"input": {"messages": [{"role": "user", "content": f"Count {i}"}]},
             "preferred_output": [{"role": "assistant", "content": f"{i} {i + 1}"}],
             "non_preferred_output": [{"role": "assistant", "content": f"{i} and then, well, more"}]}
            for i in range(10)]
    job = oa.fine_tuning.jobs.create(model=two_engines.base, training_file=upload_jsonl(oa, rows),
                                     method={"type": "dpo", "dpo": {"hyperparameters": {  # type: ignore[typeddict-item]
                                         "n_epochs": 2, "batch_size": 5}}})
    done = poll_job(oa, job.id, timeout=180, interval=0.2)
    assert done.status == "succeeded", done.error
    assert _job_engine(oa, job.id) in ("engine-0", "engine-1")
    steps = [e.data for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data
             if e.type == "metrics" and "valid_loss" not in e.data]
    assert len(steps) == 4 and all("rewards/accuracies" in d for d in steps)
    assert steps[0]["train_loss"] < steps[-1]["train_loss"]  # newest first: the loss went down
