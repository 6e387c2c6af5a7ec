"""The C attention kernels (pagedllm/csrc/paged_attention.c): built on first use with the system compiler,
cached, and called through ctypes. Where they cannot take the tensors, or no compiler is available, the
CPU path falls back to the torch backend (see `dispatch`).

One call attends every sequence of a step (decode tokens and prefill chunks) in place through the block
table. bf16 runs the AVX512-BF16 kernel where the compiler targets it (this machine's `-march=native`)
and the head dim is a multiple of 32; everything else runs the portable C kernel. A sliding window or
soft-capping runs each kernel's general specialization; without them the plain one runs, unchanged. An
int8 cache (`kv_quant`'s rows) runs the portable kernel of the query's dtype, its rows dequantized to
float32 a chunk at a time.

On a CPU with AMX, a long bf16 prefill chunk (`runs_on_sdpa`; without soft-capping, on a bf16 cache) runs
instead on torch's fused `scaled_dot_product_attention`, whose flash kernel tiles Q.K^T and P.V into AMX
GEMMs: the chunk's context is gathered from its blocks, the causal (and window) mask placed after its cached
positions. Products accumulate in float32 and the softmax is exact in float32, with probabilities rounded
to bf16 for P.V, as in the C kernel (which divides by the sum of the rounded ones, SDPA by the unrounded).
The other sequences of the step still run in one C kernel call. Without AMX the C kernel is the faster
(docs/PERFORMANCE.md), and it runs every chunk.

Set PAGEDLLM_NATIVE=0 to disable the C kernel (see `pagedllm.native`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionCall, AttentionMetadata, PrefillChunk

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
    *[ctypes.c_int64] * 8,
    ctypes.c_float,
    ctypes.c_int64,
    ctypes.c_float,
]
_TANH = "paged_attention_tanh"  # the kernels' tanh, exported for the tests
_WRITE_KV = "paged_attention_write_kv"
# Where a chunk's attention is GEMM-shaped enough for SDPA's AMX tiles to beat the C kernel by 1.5x or more:
# enough query rows per tile and enough scores in all (measured on the AMX kind, docs/PERFORMANCE.md).
SDPA_MIN_QUERY = 64
SDPA_MIN_SCORES = 128 * 256


@cache
def has_amx() -> bool:
    return "amx_bf16" in native.cpu_flags().split()


def runs_on_sdpa(q_len: int, seq_len: int, dtype: torch.dtype) -> bool:
    """Whether a prefill chunk of `q_len` query tokens over `seq_len` positions runs on SDPA."""
    return dtype == torch.bfloat16 and q_len >= SDPA_MIN_QUERY and q_len * seq_len >= SDPA_MIN_SCORES and has_amx()


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
    getattr(lib, _WRITE_KV).argtypes = [*[ctypes.c_void_p] * 5, *[ctypes.c_int64] * 7]
    getattr(lib, _WRITE_KV).restype = None
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


def takes_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernels can read and write these caches: on the CPU, any block, position and head strides
    (the same for K and V), contiguous rows."""
    return k_cache.device.type == "cpu" and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernels run this call."""
    return query.device.type == "cpu" and takes_shape(query.dtype, query.shape[1], query.shape[-1], k_cache, v_cache)


def takes_shape(
    dtype: torch.dtype, num_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether the C kernels take CPU queries of `dtype` with `num_heads` heads of `head_dim` on these caches."""
    return (
        dtype in _PORTABLE
        and k_cache.dtype in (dtype, torch.int8)
        and takes_caches(k_cache, v_cache)
        and head_dim <= MAX_HEAD_DIM
        and num_heads // k_cache.shape[2] <= MAX_GROUP
        and library() is not None
    )


def kernel_name(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> str:
    """The kernel for queries of `dtype` on a cache of `cache_dtype` (default: the same)."""
    if cache_dtype == torch.int8:
        return _INT8_KV[dtype]
    if dtype == torch.bfloat16 and head_dim % 32 == 0 and has_fast_bf16():
        return _FAST_BF16
    return _PORTABLE[dtype]


@dataclass(frozen=True, slots=True)
class SdpaSplit:
    """A step's sequences as the CPU backend runs them: `chunks` on SDPA, the others (`rest`, rows `rest_rows`
    of the flat batch, in order) in one C kernel call; `rest_rows` is None when nothing runs on SDPA."""

    chunks: list[PrefillChunk]
    rest: AttentionMetadata | None
    rest_rows: torch.Tensor | None


def sdpa_split(metadata: AttentionMetadata, dtype: torch.dtype) -> SdpaSplit:
    chunks = [c for c in metadata.prefills if runs_on_sdpa(c.rows.stop - c.rows.start, c.seq_len, dtype)]
    if not chunks:
        return SdpaSplit([], metadata, None)
    on_sdpa = {c.rows.start for c in chunks}
    starts = metadata.query_start_loc.tolist()
    rest = [s for s in range(len(starts) - 1) if starts[s] not in on_sdpa]
    if not rest:
        return SdpaSplit(chunks, None, torch.empty(0, dtype=torch.long))
    index = torch.tensor(rest, dtype=torch.long)
    rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in rest])
    lens = [starts[s + 1] - starts[s] for s in rest]
    rest_starts = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tables, seq_lens = metadata.block_tables[index], metadata.seq_lens[index]
    return SdpaSplit(chunks, AttentionMetadata.build(tables, seq_lens, rest_starts, metadata.block_size, "cpu"), rows)


def attend(call: AttentionCall) -> torch.Tensor:
    """Every sequence's query tokens (see `AttentionCall`): long prefill chunks on SDPA where the call allows
    it, the rest in one C kernel call. Only for tensors `supports` accepts."""
    if call.softcap or call.k_cache.dtype != call.query.dtype:
        return _kernel(call.query, call)
    split = call.metadata.derived(f"cpu_sdpa_split/{call.query.dtype}", lambda m: sdpa_split(m, call.query.dtype))
    if split.rest_rows is None:
        return _kernel(call.query, call)
    out = torch.empty(call.query.shape, dtype=call.query.dtype)
    if split.rest is not None:
        rest = AttentionCall(call.query, call.k_cache, call.v_cache, split.rest, call.scale, call.window)
        out.index_copy_(0, split.rest_rows, _kernel(call.query.index_select(0, split.rest_rows), rest))
    for chunk in split.chunks:
        out[chunk.rows] = _sdpa_chunk(call, chunk)
    return out


def _sdpa_chunk(call: AttentionCall, chunk: PrefillChunk) -> torch.Tensor:
    """One chunk's `[q_len, H, D]` through SDPA: its context gathered from the block holding its first
    query's window start (the entries before it are never read), masked causally after the cached tokens."""
    query, window = call.query[chunk.rows], int(call.window)
    q_len, seq_len = query.shape[0], chunk.seq_len
    block_size, num_kv_heads = call.k_cache.shape[1], call.k_cache.shape[2]
    first_query = seq_len - q_len
    lowest = (max(0, first_query - window + 1) if window > 0 else 0) // block_size * block_size
    block_ids = chunk.block_tables[0, lowest // block_size : -(-seq_len // block_size)]
    keys, values = (
        cache.index_select(0, block_ids).view(-1, num_kv_heads, cache.shape[3])[: seq_len - lowest].transpose(0, 1)
        for cache in (call.k_cache, call.v_cache)
    )
    mask = None
    if lowest != first_query or window > 0:
        key_positions = torch.arange(lowest, seq_len)
        query_positions = torch.arange(first_query, seq_len)[:, None]
        mask = key_positions[None, :] <= query_positions
        if window > 0:
            mask &= key_positions[None, :] > query_positions - window
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=call.scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Store `key`/`value` `[T, H_kv, row]` (already in the caches' dtype) at each token's slot, a negative slot
    skipped, with the C loop; False, with nothing written, where it cannot (no compiler, caches it cannot take)."""
    lib = library()
    if lib is None or not takes_caches(k_cache, v_cache) or slot_mapping.device.type != "cpu":
        return False
    key, value, slots = key.contiguous(), value.contiguous(), slot_mapping.to(torch.int64).contiguous()
    element = k_cache.element_size()
    getattr(lib, _WRITE_KV)(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        k_cache.shape[2],
        k_cache.shape[3] * element,
        k_cache.shape[1],
        *(stride * element for stride in k_cache.stride()[:3]),
    )
    return True


def _kernel(query: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """The C kernel over `query` (the rows `call.metadata` describes)."""
    lib = library()
    assert lib is not None
    query, k_cache, metadata = query.contiguous(), call.k_cache, call.metadata
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
        *k_cache.stride()[:3],
        call.scale,
        int(call.window),
        float(call.softcap),
    )
    return out
