"""Small C kernels for the CPU, built on first use with the system C compiler and loaded with ctypes.

No torch headers are involved, so a build takes well under a second. The shared object is cached
under `~/.cache/coserve/native` (or `$COSERVE_CACHE_DIR`), keyed by the source and this machine's CPU
flags (it is compiled with -march=native). Without a compiler, `load_paged_decode()` returns None and
the engine uses its pure-torch attention path, which gives the same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("paged_decode.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    root = os.environ.get("COSERVE_CACHE_DIR") or Path.home() / ".cache" / "coserve"
    return Path(root) / "native"


def _build(source: Path) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        return None
    key = hashlib.sha256(source.read_bytes() + _cpu_flags().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        # Not -ffast-math: linked into a shared object it sets flush-to-zero for the whole process
        # (crtfastmath.o), changing torch's numerics too. Reassociation alone lets gcc vectorise the
        # dot products; no-math-errno lets it vectorise expf.
        base = [compiler, "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
                "-fassociative-math", "-fno-signed-zeros", "-fPIC", "-shared", "-o", str(built),
                str(source), "-lm"]
        # OpenMP splits the sequences over the cores; without libgomp the pragma is ignored (1 thread).
        for cmd in (base + ["-fopenmp"], base):
            if subprocess.run(cmd, capture_output=True).returncode == 0:
                os.replace(built, target)  # atomic: concurrent builders never see a partial file
                return target
    return None


class PagedDecode:
    """ctypes binding of `paged_decode_f32`."""

    def __init__(self, library: Path) -> None:
        self._fn = ctypes.CDLL(str(library)).paged_decode_f32
        self._fn.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 tables: torch.Tensor, ctx_lens: torch.Tensor, out: torch.Tensor,
                 block_size: int) -> None:
        """out[b] = softmax(q[b] k^T / sqrt(d)) v over the ctx_lens[b] positions of sequence b.

        All tensors must be contiguous float32 (int64 for tables, ctx_lens) on the CPU. The
        sequences are split over torch's intra-op thread count.
        """
        batch, heads, dim = q.shape
        status = self._fn(q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), tables.data_ptr(),
                          ctx_lens.data_ptr(), out.data_ptr(), batch, heads, k_slots.shape[1], dim,
                          block_size, tables.shape[1], dim ** -0.5, torch.get_num_threads())
        if status != 0:
            raise MemoryError("paged_decode_f32 could not allocate its scratch buffer")


@cache
def load_paged_decode() -> PagedDecode | None:
    """The compiled kernel, or None where no C compiler is available (torch fallback)."""
    library = _build(_SOURCE)
    return PagedDecode(library) if library is not None else None
