"""The C attention kernels (pagedllm/csrc/paged_attention.c): built on first use with the system compiler,
cached, and called through ctypes. Where they cannot take the tensors, or no compiler is available, the
CPU path falls back to the torch backend (see `dispatch`).

One call attends every sequence of a step (decode tokens and prefill chunks) in place through the block
table. bf16 runs the AVX512-BF16 kernel where the compiler targets it (this machine's `-march=native`)
and the head dim is a multiple of 32; everything else runs the portable C kernel. A sliding window or
soft-capping runs each kernel's general specialization; without them the plain one runs, unchanged. An
int8 cache (`kv_quant`'s rows) runs the portable kernel of the query's dtype, its rows dequantized to
float32 a chunk at a time.

Set PAGEDLLM_NATIVE=0 to disable it (see `pagedllm.native`).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from pagedllm import native
from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionCall

_PORTABLE = {torch.bfloat16: "paged_attention_bf16_portable", torch.float32: "paged_attention_f32_portable"}
_INT8_KV = {
    torch.bfloat16: "paged_attention_bf16_int8kv_portable",
    torch.float32: "paged_attention_f32_int8kv_portable",
}
_FAST_BF16 = "paged_attention_bf16_avx512"  # only built where the compiler targets AVX512-BF16
# The C side's limits: MAX_HEAD_DIM, and MAX_ITEM_ROWS query heads per KV head.
MAX_HEAD_DIM = 256
MAX_GROUP = 64
# query, k_cache, v_cache, block_tables, table_stride, seq_lens, query_start_loc, out, num_seqs, num_heads,
# num_kv_heads, head_dim, block_size, scale, window, softcap
_ARGTYPES = [
    *[ctypes.c_void_p] * 4,
    ctypes.c_int64,
    *[ctypes.c_void_p] * 3,
    *[ctypes.c_int64] * 5,
    ctypes.c_float,
    ctypes.c_int64,
    ctypes.c_float,
]
_TANH = "paged_attention_tanh"  # the kernels' tanh, exported for the tests


@cache
def library() -> ctypes.CDLL | None:
    lib = native.load("paged_attention.c")
    if lib is None:
        return None
    for name in (*_PORTABLE.values(), *_INT8_KV.values(), _FAST_BF16):
        if hasattr(lib, name):
            kernel = getattr(lib, name)
            kernel.argtypes = _ARGTYPES
            kernel.restype = None
    getattr(lib, _TANH).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    getattr(lib, _TANH).restype = None
    return lib


def kernel_tanh(x: torch.Tensor) -> torch.Tensor:
    """The soft-capping tanh of the C kernels, elementwise over float32 `x` (for the tests)."""
    lib = library()
    assert lib is not None
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty_like(x)
    getattr(lib, _TANH)(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def has_fast_bf16() -> bool:
    """Whether the AVX512-BF16 kernel was compiled (the compiler targets a CPU that has it)."""
    lib = library()
    return lib is not None and hasattr(lib, _FAST_BF16)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _PORTABLE
        and k_cache.dtype in (query.dtype, torch.int8)
        and k_cache.is_contiguous()
        and query.shape[-1] <= MAX_HEAD_DIM
        and query.shape[1] // k_cache.shape[2] <= MAX_GROUP
        and library() is not None
    )


def kernel_name(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> str:
    """The kernel for queries of `dtype` on a cache of `cache_dtype` (default: the same)."""
    if cache_dtype == torch.int8:
        return _INT8_KV[dtype]
    if dtype == torch.bfloat16 and head_dim % 32 == 0 and has_fast_bf16():
        return _FAST_BF16
    return _PORTABLE[dtype]


def attend(call: AttentionCall) -> torch.Tensor:
    """Every sequence's query tokens in one kernel call (see `AttentionCall`). Only for tensors `supports`
    accepts."""
    lib = library()
    assert lib is not None
    query, k_cache, metadata = call.query.contiguous(), call.k_cache, call.metadata
    out = torch.empty(query.shape, dtype=query.dtype)
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], kv_quant.head_dim(k_cache)
    block_tables = metadata.block_tables
    getattr(lib, kernel_name(query.dtype, head_dim, k_cache.dtype))(
        query.data_ptr(),
        k_cache.data_ptr(),
        call.v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        metadata.seq_lens.data_ptr(),
        metadata.query_start_loc.data_ptr(),
        out.data_ptr(),
        metadata.seq_lens.numel(),
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        call.scale,
        int(call.window),
        float(call.softcap),
    )
    return out
