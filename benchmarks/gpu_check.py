"""The GPU check: one command that proves coserve's CUDA paths on a bare GPU machine (issue 33).

Parts, in this order (``--parts`` runs a subset; each prints its time):

* ``attention``  which attention path ran (the C decode kernel is the CPU's; CUDA takes torch's SDPA)
* ``parity``     the native engine vs transformers (+ peft) on four model shapes, base and LoRA rows in one
                 batch: fp32 greedy tokens identical, bf16 log-probs within a stated tolerance
* ``gradient``   the windowed trainer's LoRA gradient vs peft's full-sequence backward (fp32 <= 1e-4)
* ``throughput`` the native engine vs transformers' batched generate (peft for the LoRA half), bf16
* ``trainer``    the trainer's peak memory per token and tokens/s vs transformers + peft
* ``coserving``  the co-serving benchmark's code: hybrid vs temporal sharing, fine-tuning rate and bound

Sizes and every tolerance: ``benchmarks/_gpu_check/`` (one module per part). Models are random weights
drawn on the machine (Llama-3.2-1B, SmolLM2-135M, Qwen2.5-0.5B and Mistral-7B shapes); ``--quick`` shrinks
everything so that ``--device cpu --quick`` runs in CI. The report: ``gpu_check.json`` and ``gpu_check.md``
in ``--out`` (default ``$OUT``, else ``benchmarks/out/gpu_check``), rewritten after every part, and the
table on stdout. Exit status 0 when every part passed, 1 when one did not, 2 when there is no CUDA device
(without ``--device cpu`` or ``--quick``: the real sizes are not run on a CPU by accident).

On the GPU machine (docs/benchmarks.md): ``bash benchmarks/gpu_check.sh`` (installs the brought wheels).
Here: ``.venv/bin/python benchmarks/gpu_check.py --device cpu --quick``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):  # the benchmarks' helpers, and coserve from this checkout
    if path not in sys.path:
        sys.path.insert(0, path)

from _gpu_check import environment  # noqa: E402  (after the path set-up)

ORDER = ("attention", "parity", "gradient", "throughput", "trainer", "coserving")
DEFAULT_BUDGET_S = {False: 420.0, True: 120.0}  # full (docs/benchmarks.md: the GPU time), --quick


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when there is one)")
    ap.add_argument("--quick", action="store_true", help="tiny models and workloads (CI: --device cpu --quick)")
    ap.add_argument("--parts", default=",".join(ORDER), help=f"comma-separated, of {','.join(ORDER)}")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="the whole run's time budget: a part that does not fit is skipped or interrupted "
                         f"(default {DEFAULT_BUDGET_S[False]:.0f}, --quick {DEFAULT_BUDGET_S[True]:.0f})")
    ap.add_argument("--out", type=Path, default=None,
                    help="report folder (default $OUT, else benchmarks/out/gpu_check)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the models are written (default: a temporary folder, removed at the end)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; --quick: 1, as the test suite: tiny models gain "
                         "nothing from a second thread, and lose much to a busy machine)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(ORDER))
    if unknown or not parts:
        ap.error(f"unknown parts {unknown}; choose from {','.join(ORDER)}")
    args.parts = [p for p in ORDER if p in parts]
    args.budget_s = args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S[args.quick]
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "out" / "gpu_check"
    args.out = (args.out or default_out).resolve()
    return args


def run(args: argparse.Namespace, work_dir: Path, started: float) -> int:
    """Set up the context and run the parts; 0 when every part passed."""
    environment.offline()
    llguidance = environment.ensure_llguidance()
    import torch

    from _gpu_check import record, runner, shapes
    from _gpu_check.context import Context
    from _gpu_check.models import ModelStore

    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    if args.device is None and not torch.cuda.is_available() and not args.quick:
        return _no_cuda(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes, model_shapes = shapes.workload(args.quick), shapes.shapes(args.quick)
    ctx = Context(device=device, quick=args.quick, sizes=sizes, shapes=model_shapes,
                  models=ModelStore(work_dir, device, model_shapes, sizes),
                  deadline=started + args.budget_s, out_dir=args.out)
    meta = environment.meta(device, ROOT, [Path(sys.executable).name, *sys.argv], llguidance)
    meta.update(quick=args.quick, parts=args.parts, budget_s=args.budget_s, models=ctx.models.notes)
    records = runner.run_parts(ctx, args.parts, meta, started)
    meta["total_s"] = time.monotonic() - started
    json_path, md_path = record.write(args.out, meta, records)
    print(record.markdown(meta, records), end="")
    print(f"wrote {json_path} and {md_path} ({meta['total_s']:.0f} s)")
    return 0 if all(r.status == record.PASS for r in records) else 1


def _no_cuda(args: argparse.Namespace) -> int:
    """No GPU where one was expected: say why (in the report too) rather than run the real sizes on a CPU."""
    import torch

    from _gpu_check import record

    try:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees {torch.cuda.device_count()} devices"
    except Exception as err:  # noqa: BLE001 - the reason is the report
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}): {err}"
    message = f"no CUDA device ({why}); --device cpu runs the real sizes on the CPU, --quick the tiny ones"
    record.write(args.out, {"device": None, "device_name": None, "date": "", "versions": {"torch": torch.__version__},
                            "error": message}, [])
    print(f"gpu_check: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="coserve-gpu-check-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, work_dir, started)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
