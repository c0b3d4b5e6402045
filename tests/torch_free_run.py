"""Run by tests/test_torch_free_processes.py in a fresh interpreter: the work of the gateway's process
and of the scheduler's process, without an engine (whose process is the only one that needs torch), then
print which heavy modules that imported. usage: python torch_free_run.py MODEL_DIR WORK_DIR, with the
engine's `TokenizerSpec` (what an engine reports in its layout) in WORK_DIR/tokenizer_spec.json"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from coserve.actors.scheduler_actor import SchedulerActor
from coserve.api.app import build_app
from coserve.contract.engine import RuntimeLayout, TokenizerSpec
from coserve.contract.messages import Admission, TokenBatch, TokenSubmission
from coserve.contract.sampling import SamplingParams
from coserve.frontend.messages import ChatSubmission
from coserve.frontend.scheduler_frontend import SchedulerFrontend
from coserve.model.config import ModelConfig
from coserve.server.options import ServeOptions
from coserve.store import MetadataStore

KEY = "sk-torch-free-0123"
LINES = [{"messages": [{"role": "user", "content": f"Say the number {i}"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]


class Direct:
    """The scheduler as the gateway reaches it, here without an engine behind it (a `SchedulerClient`)."""

    def __init__(self, actor: SchedulerActor) -> None:
        self.actor = actor

    async def start(self) -> None: ...

    async def close(self) -> None:
        await self.actor.shutdown()

    async def submit(self, sub: TokenSubmission) -> Admission:
        return await self.actor.submit(sub)

    def stream(self, request_id: str) -> AsyncIterator[TokenBatch]:
        return self.actor.stream(request_id)

    async def stop(self, request_id: str, index: int) -> bool:
        return await self.actor.stop(request_id, index)

    async def abort(self, request_id: str) -> bool:
        return await self.actor.abort(request_id)

    async def metrics_text(self) -> str:
        return await self.actor.metrics_text()

    async def health(self) -> str | None:
        return None


async def main(model: str, work: Path) -> dict:
    import httpx

    (work / "tenants.yaml").write_text(json.dumps({"tenants": {"acme": {"api_keys": [KEY]}}}))
    opts = ServeOptions(model=model, tenants=str(work / "tenants.yaml"), data_dir=str(work / "data"))
    tenants = opts.load_tenants()
    # The scheduler's process: the actor with the server's policy and a job manager over the data dir.
    actor = SchedulerActor(opts.scheduler_settings(tenants), opts.policy_factory(tenants))
    layout = RuntimeLayout(num_kv_blocks=64, block_size=16, max_model_len=256,
                           vocab_size=ModelConfig.from_pretrained(model).vocab_size, num_adapter_slots=2,
                           max_lora_rank=16,
                           tokenizer=TokenizerSpec(**json.loads((work / "tokenizer_spec.json").read_text())))
    actor.register_engine("engine-0", layout)
    # The gateway's process: the FastAPI app and its frontend (tokenizer, chat template, detokenizer).
    frontend = SchedulerFrontend.for_engine(model, Direct(actor), layout)
    app = build_app(MetadataStore(opts.data_dir), tenants, [opts.base_model_id], scheduler=frontend,
                    max_lora_rank=layout.max_lora_rank)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                 headers=headers) as http:
        data = "".join(json.dumps(line) + "\n" for line in LINES).encode()
        file = (await http.post("/v1/files", files={"file": ("t.jsonl", data)}, data={"purpose": "fine-tune"})).json()
        job = (await http.post("/v1/fine_tuning/jobs", json={"model": opts.base_model_id,
                                                            "training_file": file["id"]})).json()
        admitted = await frontend.submit(ChatSubmission(
            request_id="chat-1", tenant="acme", messages=[{"role": "user", "content": "Hello there"}],
            sampling=SamplingParams(max_tokens=4)))
        plan = await actor.exchange("engine-0", None)  # starts the job loop too
        status = job["status"]
        for _ in range(400):  # the job manager validates and tokenizes the file, then runs the job
            status = (await http.get(f"/v1/fine_tuning/jobs/{job['id']}")).json()["status"]
            if status in ("running", "failed"):
                break
            await asyncio.sleep(0.05)
    await frontend.close()
    return {"admitted": admitted.rejection is None, "prompt_tokens": admitted.prompt_tokens,
            "planned": [s.token_ids for s in plan.new_sequences], "chunks": [c.num_tokens for c in plan.chunks],
            "job": status, "loaded": sorted({"torch", "transformers.modeling_utils"} & set(sys.modules))}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], Path(sys.argv[2])))))
