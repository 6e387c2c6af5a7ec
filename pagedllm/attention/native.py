"""The C decode kernel (csrc/paged_decode.c): built on first use with the system compiler, cached,
and called through ctypes. When no compiler is available the CPU path falls back to torch ops.

Set PAGEDLLM_NATIVE=0 to disable it (see `pagedllm.native`).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pagedllm import native

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_KERNELS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_UNROLLED_HEAD_DIMS = (64, 128)
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5 + [ctypes.c_float]
_ARGTYPES[4] = ctypes.c_int64  # the block table's row stride


@cache
def library() -> ctypes.CDLL | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    for prefix in _KERNELS.values():
        for suffix in ("d64", "d128", "any"):
            kernel = getattr(lib, f"{prefix}_{suffix}")
            kernel.argtypes = _ARGTYPES
            kernel.restype = None
    return lib


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
