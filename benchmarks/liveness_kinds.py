"""The liveness check for every kind of job: the first thing a freshly started server does is a supervised
job, a DPO job, a reinforcement job or a Tinker training run, under hard settings, and it must finish.

The shared acceptance check (`liveness.py`) holds this for a supervised job; its README asks the same of
every new kind of job. For each kind this starts `coserve serve --local` afresh (by default on
SmolLM2-135M-Instruct, `--tpot-slo-ms 30 --max-batch-tokens 64 --kv-cache-memory-gb 0.1 --max-model-len 2048`:
an SLO below one decode iteration on a 2-core CPU, tiny batches, a small KV cache), optionally with `--chat-clients`
clients streaming chat the whole time, and, before any other request, runs:

* supervised: the shared check's job (16 short rows, 2 epochs);
* dpo: 16 preference pairs, 1 epoch;
* reinforcement: 12 addition prompts, a `string_check` grader, 1 epoch of batches of 4;
* tinker: the official SDK's `forward_backward` + `optim_step` three times, `save_weights_for_sampler`,
  and a `sample` of the saved weights.

Reported per kind: whether it finished within `--limit-s`, its time, its steps (a job's last `metrics`
event) and, when it did not finish, its status and last events; with chat, the chat requests served and
their median time per output token. Exit status 1 when any kind did not.

usage: .venv/bin/python benchmarks/liveness_kinds.py [--model DIR] [--kinds supervised,dpo,reinforcement,tinker]
       [--limit-s 600] [--chat-clients 0] [--json OUT] [--serve-flag=--finetune-min-share=0.1 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from liveness_hard import PROMPTS, ROWS, chat_loop  # noqa: E402

KEY, TINKER_KEY = "sk-alpha-bars", "tml-alpha-0123456789"
HARD_FLAGS = ["--tpot-slo-ms", "30", "--max-batch-tokens", "64", "--kv-cache-memory-gb", "0.1",
              "--max-model-len", "2048"]
GRADER = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
          "reference": "{{ item.answer }}", "operation": "eq"}


def _pair(i: int) -> dict[str, Any]:
    return {"input": {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]},
            "preferred_output": [{"role": "assistant", "content": f"{2 * i}."}],
            "non_preferred_output": [{"role": "assistant", "content": f"Let me think about {i} for a while."}]}


def _prompt(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "Answer with a number."},
                         {"role": "user", "content": f"What is {i} plus {i}?"}], "answer": str(2 * i)}


JOBS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {  # kind: (training rows, create() arguments)
    "supervised": (ROWS, {"hyperparameters": {"n_epochs": 2}}),
    "dpo": ([_pair(i) for i in range(16)], {"method": {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1}}}}),
    "reinforcement": ([_prompt(i) for i in range(12)], {"method": {"type": "reinforcement", "reinforcement": {
        "grader": GRADER, "max_completion_tokens": 8,
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "compute_multiplier": 1}}}}),
}


def _upload(oa: Any, rows: list[dict[str, Any]]) -> str:
    data = "\n".join(json.dumps(row) for row in rows).encode()
    return str(oa.files.create(file=("train.jsonl", data), purpose="fine-tune").id)


def run_job(oa: Any, base: str, kind: str, limit_s: float) -> dict[str, Any]:
    """Create the kind's job and poll it until it ends or `limit_s` runs out."""
    rows, arguments = JOBS[kind]
    start = time.perf_counter()
    job = oa.fine_tuning.jobs.create(model=base, training_file=_upload(oa, rows), **arguments)
    step = 0
    while job.status not in ("succeeded", "failed", "cancelled") and time.perf_counter() - start < limit_s:
        time.sleep(2)
        job = oa.fine_tuning.jobs.retrieve(job.id)
        events = oa.fine_tuning.jobs.list_events(job.id, limit=5).data
        step = max([step] + [int(e.data.get("step", 0)) for e in events if e.type == "metrics" and e.data])
        print(f"{kind:>13} {time.perf_counter() - start:6.0f} s  {job.status:9}  step {step}", flush=True)
    out = {"finished": job.status == "succeeded", "status": job.status, "seconds": time.perf_counter() - start,
           "steps": step}
    if job.status != "succeeded":
        out["last_events"] = [e.message for e in oa.fine_tuning.jobs.list_events(job.id, limit=5).data]
    return out


def run_tinker(url: str, base: str, limit_s: float) -> dict[str, Any]:
    """Three forward_backward + optim_step rounds, save_weights_for_sampler and a sample, each waited for
    at most what is left of `limit_s`."""
    import tinker
    from tinker import types

    start = time.perf_counter()

    def left() -> float:
        return max(1.0, limit_s - (time.perf_counter() - start))

    tokens = [int(t) for t in np.random.default_rng(0).integers(100, 40000, size=65)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
    service = tinker.ServiceClient(base_url=f"{url}/tinker", api_key=TINKER_KEY)
    calls: list[tuple[str, float]] = []
    try:
        training = service.create_lora_training_client(base_model=base, rank=8).result(timeout=left())
        for i in range(3):
            training.forward_backward([datum], "cross_entropy").result(timeout=left())
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=left())
            calls.append((f"round {i}", time.perf_counter() - start))
        saved = training.save_weights_for_sampler("liveness").result(timeout=left())
        calls.append(("save_weights_for_sampler", time.perf_counter() - start))
        sampler = service.create_sampling_client(model_path=saved.path).result(timeout=left())
        out = sampler.sample(prompt=types.ModelInput.from_ints(tokens[:8]), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0)).result(timeout=left())
        calls.append(("sample", time.perf_counter() - start))
        finished = len(out.sequences[0].tokens) > 0
    except Exception as err:  # a timeout or a failed call: reported, the other kinds go on
        return {"finished": False, "status": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start,
                "calls": calls}
    finally:
        service.close("success")
    return {"finished": finished, "status": "done", "seconds": time.perf_counter() - start, "calls": calls}


def one_kind(model: Path, work: Path, kind: str, limit_s: float, chat_clients: int,
             flags: list[str]) -> dict[str, Any]:
    """A fresh server for `kind`: chat clients first (when asked), then the kind's work."""
    from local_server import serve_subprocess

    tenants = work / "tenants.yaml"
    tenants.write_text(json.dumps({"tenants": {"alpha": {"api_keys": [KEY, TINKER_KEY]}}}))
    with serve_subprocess(model, tenants, work / "data", KEY, flags) as (_proc, test_client):
        oa = test_client.with_options(timeout=300, max_retries=3)
        base = oa.models.list().data[0].id
        stop, chats = threading.Event(), []
        threads = [threading.Thread(target=chat_loop, args=(oa, base, PROMPTS[i % len(PROMPTS)], stop, chats),
                                    daemon=True) for i in range(chat_clients)]
        for thread in threads:
            thread.start()
        if threads:
            time.sleep(10)  # the chat is running before the work arrives
        url = str(oa.base_url).rstrip("/").removesuffix("/v1")
        result = run_tinker(url, base, limit_s) if kind == "tinker" else run_job(oa, base, kind, limit_s)
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    tpot = sorted(c["tpot_s"] for c in chats)
    return {**result, "chat_requests": len(chats),
            "chat_tpot_ms_median": 1000 * tpot[len(tpot) // 2] if tpot else None}


KINDS = (*JOBS, "tinker")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--kinds", default="supervised,dpo,reinforcement,tinker")
    parser.add_argument("--limit-s", type=float, default=600.0)
    parser.add_argument("--chat-clients", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve-flag", action="append", default=[], help="an extra `coserve serve` flag")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}: use {', '.join(KINDS)}")
    from coserve.model.known_models import fetch_model

    model = args.model or fetch_model("smollm2-135m-instruct")
    header = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(model),
              "flags": HARD_FLAGS + args.serve_flag, "chat_clients": args.chat_clients,
              "loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    results = {}
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            results[kind] = one_kind(model, Path(tmp), kind, args.limit_s, args.chat_clients,
                                     HARD_FLAGS + args.serve_flag)
        print(f"{kind:>13}: {'finished' if results[kind]['finished'] else 'NOT finished'} "
              f"({results[kind]['status']}) in {results[kind]['seconds']:.0f} s", flush=True)
    header["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    report = {**header, "kinds": results}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["finished"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
