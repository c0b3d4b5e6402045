"""`coserve serve --engine vllm`: the API journey with the official `openai` client (chat, stream, files,
a fine-tuning job, its fine-tuned model served by vLLM the moment it succeeds), the engine's refusals, and the same
application on Ray (structured output: test_vllm_structured_server.py). Replies are checked token for token against
coserve's own engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from local_server import ADMIN_KEY, local_app, poll_job, scrape, upload_jsonl
from uvicorn_thread import serve_in_thread
from vllm_support import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from coserve.contract.engine import EngineKind  # noqa: E402

KEY = "sk-vllm-tenant-0123"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
LINES = [{"messages": [{"role": "user", "content": f"Name fruit number {i}."},
                       {"role": "assistant", "content": f"Fruit {i} is a banana."}]} for i in range(12)]


class Server:
    def __init__(self, url: str, base: str, app: Any) -> None:
        self.url, self.base, self.app = url, base, app

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    @property
    def runtime(self) -> Any:
        """The vLLM runtime inside the engine (local mode: the same process)."""
        return self.app.state.gateway.scheduler.client.engine.engine.runtime  # frontend -> LocalSchedulerClient


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("vllm-server")
    app, opts = local_app(llama_dir, root, {"acme": {"api_keys": [KEY]}}, engine=EngineKind.VLLM)
    with serve_in_thread(app) as url:
        yield Server(url, opts.base_model_id, app)


@pytest.fixture(scope="module")
def native(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), dtype="float32", max_num_seqs=8, max_batch_tokens=256)


def _chat(oa: openai.OpenAI, model: str, **extra: Any) -> str:
    out = oa.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0, **extra)
    return out.choices[0].message.content or ""


def test_chat_and_stream_match_the_native_engine(server: Server, native: LLM) -> None:
    oa = server.client()
    assert [m.id for m in oa.models.list()] == [server.base]
    assert oa.models.retrieve(server.base).model_extra["coserve"] == {"engine": "vllm", "dtype": "float32"}
    expected = native.chat(HELLO, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert _chat(oa, server.base) == expected
    chunks = list(oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    lp = oa.chat.completions.create(model=server.base, messages=HELLO, max_tokens=3, temperature=0, logprobs=True,
                                    top_logprobs=2).choices[0].logprobs
    assert lp is not None and [len(t.top_logprobs) for t in lp.content] == [2, 2, 2]


def test_rank_above_vllms_limit_is_refused_at_job_creation(server: Server) -> None:
    oa = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES),
                                   extra_body={"lora": {"r": 128, "lora_alpha": 16}})
    assert info.value.body["param"] == "lora.r" and "max_lora_rank 64" in info.value.body["message"]


def test_job_trained_on_vllm_is_served_by_vllm_at_once(server: Server, native: LLM) -> None:
    oa = server.client()
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=upload_jsonl(oa, LINES), seed=1,
                                     suffix="fruit", hyperparameters={"n_epochs": 3, "batch_size": 2,
                                                                      "learning_rate_multiplier": 10},
                                     extra_body={"lora": {"r": 8, "lora_alpha": 16}})
    base_reply = _chat(oa, server.base)  # served while the job trains
    job = poll_job(oa, job.id, timeout=300, interval=0.2)
    assert job.status == "succeeded", job.error
    final = server.app.state.gateway.store.models.get("acme", job.fine_tuned_model).adapter_path
    assert server.runtime.published(final)  # loaded into vLLM by the step that saved it
    tuned = _chat(oa, job.fine_tuned_model)
    reference = native.chat(HELLO, SamplingParams(temperature=0, max_tokens=16),
                            lora_request=LoRARequest("ft", 1, final))[0].outputs[0].text
    assert tuned == reference and tuned != base_reply
    assert len(oa.fine_tuning.jobs.checkpoints.list(job.id).data) == 3
    assert any(e.type == "metrics" for e in oa.fine_tuning.jobs.list_events(job.id).data)
    text = scrape(server.url)
    # The scheduler's metrics, as on coserve's engine: latency histograms, tokens by kind (fine-tuning too).
    for series, label in (("coserve_time_to_first_token_seconds_count", ""),
                          ("coserve_tokens_total{", 'kind="finetune"')):
        assert any(line.startswith(series) and label in line and float(line.split()[-1]) > 0
                   for line in text.splitlines()), series


def test_another_vllm_version_stops_serve_with_the_install_command(llama_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`coserve serve --engine vllm` with another vLLM: exit 2 before loading, naming `make vllm`."""
    import vllm
    from coserve.cli import main

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(ValueError, match=r"found vLLM 0\.33\.1.*`make vllm`"):
        local_app(llama_dir, tmp_path, {"acme": {"api_keys": [KEY]}}, engine=EngineKind.VLLM)
    code = main(["serve", "--local", "--engine", "vllm", "--model", str(llama_dir), "--tenants", str(tenants),
                 "--data-dir", str(tmp_path / "data")])
    assert code == 2


@pytest.mark.ray
def test_engine_vllm_on_ray(llama_dir: Path, tmp_path: Path, native: LLM) -> None:
    """The same application on Ray (`deploy/serve.yaml`'s builder with `engine: vllm`): the EngineActor
    runs vLLM in its own process and the reply is coserve's engine's, token for token."""
    import ray
    from ray import serve

    from coserve.server.assembly import RAY_NAMESPACE, app_builder
    from deploy_config import local_args, serve_config
    from local_server import free_port

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}, "admin_api_keys": [ADMIN_KEY]}))
    (app,) = serve_config()["applications"]
    args = {**local_args(app["args"], llama_dir, tenants, tmp_path / "data"), "max_num_seqs": 8, "engine": "vllm"}
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder(args), name=app["name"], route_prefix=app["route_prefix"])
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        expected = native.chat(HELLO, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
        assert _chat(oa, llama_dir.name) == expected
        serve.shutdown()
    finally:
        ray.shutdown()
