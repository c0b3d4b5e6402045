"""Per-iteration overhead of the Ray path against `--local`: the scheduler <-> engine boundary.

The same workload runs twice on the same SchedulerActor / EngineActor classes, submitted and read through the
gateway's `SchedulerFrontend` (prompts in, text out) over its scheduler client: in-process (`LocalSchedulerClient`:
scheduler on an asyncio loop, engine loop on a thread, one `run_coroutine_threadsafe` per iteration) and as Ray
actors (`RaySchedulerClient`: one `exchange` actor call per iteration between engine and scheduler, plan and result
pickled, plus one `poll` call per iteration that carries every live stream's tokens to the gateway). The engine loop
measures where its time goes: inside `Engine.step`, and outside it (the `exchange` call: transport plus the
scheduler's own work of applying the result and planning; detokenizing is the gateway's). HTTP is not included.

usage: python benchmarks/ray_overhead.py [--model DIR] [--requests 16] [--max-tokens 128] [--repeats 3]
                                        [--drain concurrent|sequential] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # both modes: one torch thread per process

from coserve.actors.client import LocalSchedulerClient, RaySchedulerClient  # noqa: E402
from coserve.actors.engine_actor import EngineActor, RayLink  # noqa: E402
from coserve.actors.scheduler_actor import SchedulerActor, SchedulerSettings  # noqa: E402
from coserve.cluster.policy_factory import CoServingPolicyFactory  # noqa: E402
from coserve.contract.engine_config import EngineConfig  # noqa: E402
from coserve.contract.sampling import SamplingParams  # noqa: E402
from coserve.frontend.messages import ChatSubmission  # noqa: E402
from coserve.frontend.scheduler_frontend import SchedulerFrontend  # noqa: E402
from coserve.planner.latency import ModelFingerprint  # noqa: E402
from coserve.planner.share_kinds import ShareKind  # noqa: E402

# Inference only, as before one engine was a cluster of one (FCFS then, VTC order now: one tenant).
INFERENCE_ONLY = CoServingPolicyFactory(ModelFingerprint("bench", "cpu", "float32"), share=ShareKind.NONE)


def submissions(count: int, max_tokens: int, tag: str) -> list[ChatSubmission]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [ChatSubmission(request_id=f"{tag}-{i}", tenant="bench",
                           messages=[{"role": "user", "content": f"Request number {i}: tell me a story."}],
                           sampling=params) for i in range(count)]


def summarize(before: dict, after: dict, wall_s: float, tokens: int) -> dict:
    iterations = after["iterations"] - before["iterations"]
    step = after["step_s"] - before["step_s"]
    outside = after["exchange_s"] - before["exchange_s"]
    return {"iterations": iterations, "wall_ms_per_iter": 1e3 * wall_s / iterations,
            "step_ms_per_iter": 1e3 * step / iterations, "outside_step_ms_per_iter": 1e3 * outside / iterations,
            "tokens_per_s": tokens / wall_s}


async def _drain(client: object, request_id: str) -> int:
    tokens = 0
    async for batch in client.stream(request_id):
        assert batch.error is None, batch.error
        tokens = batch.completion_tokens
    return tokens


async def run_once(args: argparse.Namespace, tag: str, client: object, stats: object) -> dict:
    """One workload through a `SchedulerFrontend` (what the gateway uses), engine stats around it."""
    subs = submissions(args.requests, args.max_tokens, tag)
    before = await stats()
    start = time.perf_counter()
    for sub in subs:
        admission = await client.submit(sub)
        assert admission.rejection is None, admission.rejection
    tokens = await _drain_all(args, [lambda s=s: _drain(client, s.request_id) for s in subs])
    wall = time.perf_counter() - start
    return summarize(before, await stats(), wall, sum(tokens))


async def _drain_all(args: argparse.Namespace, drains: list) -> list[int]:
    """`concurrent`: every stream read live (as the gateway does); `sequential`: one at a time (the
    others' batches wait and come in one piece)."""
    if args.drain == "concurrent":
        return await asyncio.gather(*(drain() for drain in drains))
    return [await drain() for drain in drains]


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".coserve/models/tiny-llama")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drain", choices=("concurrent", "sequential"), default="concurrent",
                        help="read all streams live (default) or one at a time")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    engine_config = EngineConfig(model=args.model, dtype="float32")
    settings = SchedulerSettings(model=args.model, max_num_seqs=args.requests)

    local = LocalSchedulerClient(SchedulerActor(settings, INFERENCE_ONLY), EngineActor(engine_config))
    layout = local.engine.layout()

    def frontend(client: object) -> SchedulerFrontend:
        return SchedulerFrontend.for_engine(args.model, client, layout)

    async def local_stats() -> dict:
        return local.engine.stats()

    async def local_runs() -> list[dict]:
        gateway = frontend(local)
        await gateway.start()
        await run_once(args, "warmup", gateway, local_stats)
        runs = [await run_once(args, f"local{r}", gateway, local_stats) for r in range(args.repeats)]
        await gateway.close()
        return runs

    results = {"local": median_of(asyncio.run(local_runs()))}

    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    engine = ray.remote(EngineActor).options(num_cpus=0).remote(engine_config)
    scheduler = ray.remote(SchedulerActor).options(num_cpus=0).remote(settings, INFERENCE_ONLY)
    ray.get(scheduler.register_engine.remote("engine-0", ray.get(engine.layout.remote())))
    ray.get(engine.start.remote(RayLink(scheduler)))

    async def ray_stats() -> dict:
        return await engine.stats.remote()

    async def ray_runs() -> list[dict]:
        client = frontend(RaySchedulerClient(scheduler))
        await run_once(args, "warmup", client, ray_stats)
        return [await run_once(args, f"ray{r}", client, ray_stats) for r in range(args.repeats)]

    results["ray"] = median_of(asyncio.run(ray_runs()))
    ray.get(scheduler.shutdown.remote())
    ray.shutdown()
    results["ray_minus_local_outside_step_ms"] = (results["ray"]["outside_step_ms_per_iter"]
                                                 - results["local"]["outside_step_ms_per_iter"])
    results["setup"] = {"model": Path(args.model).name, "requests": args.requests, "max_tokens": args.max_tokens,
                        "drain": args.drain,
                        "repeats": args.repeats, "machine": f"{platform.machine()} {os.cpu_count()} cores, "
                                                            f"{platform.system()} {platform.release()}"}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
