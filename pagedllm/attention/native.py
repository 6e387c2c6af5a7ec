"""The C decode kernel (csrc/paged_decode.c): built on first use with the system compiler, cached,
and called through ctypes. When no compiler is available the CPU path falls back to torch ops.

Set PAGEDLLM_NATIVE=0 to disable it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# The parts of -ffast-math that let reductions vectorize, but not -ffast-math itself: linking with it
# sets flush-to-zero for the whole process.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
    "-shared",
    "-fPIC",
)
_KERNELS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_UNROLLED_HEAD_DIMS = (64, 128)
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5 + [ctypes.c_float]
_ARGTYPES[4] = ctypes.c_int64  # the block table's row stride


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    return Path(root) / "native"


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDLLM_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("native decode kernel unavailable (%s); using the torch path", error)
        return None
    for prefix in _KERNELS.values():
        for suffix in ("d64", "d128", "any"):
            kernel = getattr(lib, f"{prefix}_{suffix}")
            kernel.argtypes = _ARGTYPES
            kernel.restype = None
    return lib


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler found")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, target)
    return target


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _KERNELS
        and k_cache.dtype == query.dtype
        and k_cache.is_contiguous()
        and query.shape[-1] <= 256
        and query.shape[1] // k_cache.shape[2] <= 64
        and library() is not None
    )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    token_index: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Write into `out[token_index[s]]` the attention of query row `token_index[s]` over the first
    `seq_lens[s]` positions of sequence s. `block_tables` int32 `[S, *]`, `seq_lens` int32, `token_index` int64."""
    lib = library()
    assert lib is not None
    query = query.contiguous()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    suffix = f"d{head_dim}" if head_dim in _UNROLLED_HEAD_DIMS else "any"
    getattr(lib, f"{_KERNELS[query.dtype]}_{suffix}")(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        token_index.data_ptr(),
        out.data_ptr(),
        token_index.numel(),
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        scale,
    )
