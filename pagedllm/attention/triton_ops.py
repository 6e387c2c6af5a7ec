"""Paged attention in Triton: the GPU path, also run on the CPU under TRITON_INTERPRET=1 by the tests.

Kernels, all on the `[num_blocks, block_size, H_kv, D]` cache layout:

- `write_kv`: one program per token copies its K/V rows into its slot; a negative slot is skipped.
- decode v1: one program per (sequence, KV head); the query heads sharing that KV head are the rows of one
  tile, so every key and value is loaded once for the whole group. It walks the context with an online
  softmax (running max, exp-sum and output, rescaled as the max grows).
- decode v2: the same walk over one partition of `partition_size` positions per program; each writes its
  partition's max logit, exp-sum and unnormalized output, and a reduce kernel merges them by the
  log-sum-exp rule (m = max m_b, o = sum e^(m_b - m) o_b / sum e^(m_b - m) l_b). More programs per
  sequence keep the GPU busy when there are few, long sequences.
- mixed: prefill chunks (after cached prefixes) and decode tokens in one launch; a program takes up to
  BLOCK_M (query token, query head) rows of one sequence and KV head, each row attending causally.

Keys and values are read in tiles of TILE positions whose blocks are looked up position by position in
the block table, so the tile width does not depend on the block size (1, 16, 32, or not a power of two).
Logits are kept in base 2 (scaled by log2 e) so the softmax uses exp2, the GPU's native exponential.

A sliding window (WINDOWED, with the runtime `window` W: position p sees p - W < j <= p) moves each walk's
start to the window start of its earliest query row, so a decode token walks O(W) positions (its v2
partitions are counted from there) and no block-table entry before that is read: the engine frees those
blocks. A mixed program's rows also mask the positions before their own window start. Soft-capping
(SOFTCAP, with runtime `cap_in` = scale / c and `cap_out` = c log2 e) turns each logit into
c tanh(s / c) before the mask. Both flags are constexpr: without them the kernels compile as before.

Dot products take float32 operands: float32 caches use exact IEEE products; bf16/fp16 values are exact
in TF32, so TF32 tensor cores give them exact products with float32 accumulation, and the softmax
weights keep 10 mantissa bits instead of bf16's 7. (Triton's interpreter also multiplies bf16 operands
of `tl.dot` as their raw bits, so a bf16 dot could not be tested on the CPU.)

An int8 cache (INT8_KV, `kv_quant`'s rows: HEAD_DIM int8 values, then their float32 scale) is read as its
integers, exact in TF32 too, with each position's scale applied to its scores after Q.K and folded into
its softmax weights before P.V. Its rows are written by `dispatch.write_kv`'s torch path, which quantizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionCall, PrefillChunk

DEFAULT_PARTITION_SIZE = 512
# vLLM's rule for its v1/v2 decode kernels: one pass while the context is short enough and either one
# partition covers it or there are already enough (sequence, head) pairs to fill the GPU.
V1_MAX_CONTEXT = 8192
V1_MIN_PARALLELISM = 512
# Tile sizes and warps chosen from ptxas's register report for sm_90 (compiled without a GPU, not yet
# timed): the largest tiles that keep every kernel free of register spills at head dims 64 and 128, for
# bf16 and float32 caches. A mixed program holds float32 query, output, key and value tiles.
TILE = 32
MIXED_BLOCK_M = 64
MIXED_NUM_WARPS = 8
# tl.dot needs every dimension of its operands to be at least 16.
MIN_DOT_DIM = 16
LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class Geometry:
    """The compile-time shape of one attention call: what the kernels specialize on."""

    group: int  # query heads per KV head
    head_dim: int
    block_size: int
    dot_precision: str
    int8_kv: bool

    @classmethod
    def of(cls, query: torch.Tensor, k_cache: torch.Tensor) -> Geometry:
        int8_kv = kv_quant.is_int8(k_cache)
        # An int8 cache's dots take the model's precision: its integers are exact either way.
        values_dtype = query.dtype if int8_kv else k_cache.dtype
        precision = "ieee" if values_dtype == torch.float32 else "tf32"
        return cls(query.shape[1] // k_cache.shape[2], query.shape[2], k_cache.shape[1], precision, int8_kv)

    @property
    def group_pad(self) -> int:
        return max(MIN_DOT_DIM, triton.next_power_of_2(self.group))

    @property
    def head_pad(self) -> int:
        return max(MIN_DOT_DIM, triton.next_power_of_2(self.head_dim))

    @property
    def decode_num_warps(self) -> int:
        # IEEE float32 dots need twice the registers of the TF32 ones: over 4 warps they would spill.
        return 8 if self.dot_precision == "ieee" else 4

    def constexprs(self) -> dict[str, int | str]:
        return {
            "HEAD_DIM": self.head_dim,
            "HEAD_PAD": self.head_pad,
            "BLOCK_SIZE": self.block_size,
            "TILE": TILE,
            "DOT_PRECISION": self.dot_precision,
            "INT8_KV": self.int8_kv,
        }


@dataclass(frozen=True, slots=True)
class Options:
    """A layer's sliding window and soft-capping, as the kernels take them: constexpr flags (the plain
    kernels compile as if they did not exist) and runtime values (one compilation serves every window)."""

    window: int
    softcap: float
    scale: float

    def runtime(self) -> tuple[int, float, float]:
        """window, cap_in = scale / softcap, cap_out = softcap * log2 e (the logits' base-2 scale)."""
        if self.softcap > 0:
            return self.window, self.scale / self.softcap, self.softcap * LOG2E
        return self.window, 0.0, 0.0

    def constexprs(self) -> dict[str, bool]:
        return {"WINDOWED": self.window > 0, "SOFTCAP": self.softcap > 0}

    def context(self, max_seq_len: int) -> int:
        """The most positions one decode token walks."""
        return min(max_seq_len, self.window) if self.window > 0 else max_seq_len


def choose_decode_version(max_seq_len: int, num_seqs: int, num_heads: int, partition_size: int) -> int:
    one_partition = max_seq_len <= partition_size
    enough_programs = num_seqs * num_heads > V1_MIN_PARALLELISM
    return 1 if max_seq_len <= V1_MAX_CONTEXT and (one_partition or enough_programs) else 2


@triton.jit
def _tanh(x):
    """tanh from exp2, as the C kernels compute it: below |x| = 0.5 its odd Taylor series to x^13, above
    (1 - e) / (1 + e) with e = exp(-2|x|), so that neither side cancels much."""
    a = tl.abs(x)
    x2 = x * x
    p = 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    series = x + x * x2 * p
    e = tl.exp2(a * (-2.0 * 1.4426950408889634))
    large = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.5, series, tl.where(x < 0, -large, large))


@triton.jit
def _row_scales(cache_ptr, offsets, in_range, HEAD_DIM: tl.constexpr):
    """The float32 scales of an int8 cache's rows at `offsets` (0 past the end)."""
    return tl.load((cache_ptr + offsets + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=in_range, other=0.0)


@triton.jit
def _attend(
    q,
    k_ptr,
    v_ptr,
    table_ptr,
    head_offset,
    start,
    end,
    lowest,
    limit,
    qk_scale,
    cap_in,
    cap_out,
    stride_b,
    stride_t,
    dims,
    dim_ok,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_WINDOWS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INT8_KV: tl.constexpr,
):
    """Attend the rows of `q` to positions [start, end) of one sequence, row r to those below limit[r] and,
    with ROW_WINDOWS, not below lowest[r]; `table_ptr` points at the sequence's block-table row, read only
    for positions in [start, end). SOFTCAP: logits tanh(dot * cap_in) * cap_out instead of dot * qk_scale.
    INT8_KV: K/V rows of int8 with their float32 scale at element HEAD_DIM. Returns the running max logit
    (base 2), exp-sum and unnormalized output of each row."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    sums = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        in_range = pos < end
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        offsets = block * stride_b + (pos % BLOCK_SIZE) * stride_t + head_offset
        kv_mask = in_range[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if INT8_KV:
            dots = dots * _row_scales(k_ptr, offsets, in_range, HEAD_DIM)[None, :]
        if SOFTCAP:  # noqa: SIM108 (constexpr branches, as before INT8_KV)
            scores = _tanh(dots * cap_in) * cap_out
        else:
            scores = dots * qk_scale
        visible = in_range[None, :] & (pos[None, :] < limit[:, None])
        if ROW_WINDOWS:
            visible = visible & (pos[None, :] >= lowest[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row that has seen no visible position yet keeps m = -inf; subtracting 0 instead keeps
        # exp2 away from -inf - (-inf) = NaN, and its weights are 0 either way.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        sums = sums * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        weights = p
        if INT8_KV:
            weights = p * _row_scales(v_ptr, offsets, in_range, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(weights, v, input_precision=DOT_PRECISION)
        m = m_new
    return m, sums, acc


@triton.jit
def _load_group_query(
    q_ptr, row, kv_head, stride_qt, stride_qh, dims, dim_ok, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr
):
    """The query heads of one KV head for query row `row`, as float32 rows [GROUP_PAD, HEAD_PAD]."""
    members = tl.arange(0, GROUP_PAD)
    member_ok = members < GROUP
    heads = kv_head * GROUP + members
    ptrs = q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(ptrs, mask=member_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    return q, heads, member_ok


@triton.jit
def _decode_kernel(
    out_ptr,
    m_out_ptr,
    l_out_ptr,
    acc_out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    rows_ptr,
    qk_scale,
    window,
    cap_in,
    cap_out,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_b,
    stride_t,
    stride_h,
    stride_table,
    num_heads,
    num_parts,
    PARTITIONED: tl.constexpr,
    PARTITION: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INT8_KV: tl.constexpr,
):
    """v1 (one pass over the whole context, normalized into `out`) or, PARTITIONED, v2 (one partition per
    program: partial results to m/l `[S, H, num_parts]` and acc `[S, H, num_parts, HEAD_DIM]`, float32).
    WINDOWED: the context, and partition 0, start at the window start seq_len - window (or 0)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
        start = first + part * PARTITION if PARTITIONED else first
    else:
        start = part * PARTITION if PARTITIONED else 0
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION, seq_len) if PARTITIONED else seq_len
    row = tl.load(rows_ptr + seq)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q, heads, member_ok = _load_group_query(q_ptr, row, kv_head, stride_qt, stride_qh, dims, dim_ok, GROUP, GROUP_PAD)
    limit = seq_len + tl.zeros([GROUP_PAD], tl.int32)
    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    # One query position: its window is the walk's start, so no row needs a mask of its own.
    m, sums, acc = _attend(
        q,
        k_ptr,
        v_ptr,
        table_ptr,
        kv_head * stride_h,
        start,
        end,
        limit,
        limit,
        qk_scale,
        cap_in,
        cap_out,
        stride_b,
        stride_t,
        dims,
        dim_ok,
        GROUP_PAD,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_SIZE,
        TILE,
        DOT_PRECISION,
        False,
        SOFTCAP,
        INT8_KV,
    )
    mask = member_ok[:, None] & dim_ok[None, :]
    if PARTITIONED:
        stat = (seq.to(tl.int64) * num_heads + heads) * num_parts + part
        tl.store(m_out_ptr + stat, m, mask=member_ok)
        tl.store(l_out_ptr + stat, sums, mask=member_ok)
        tl.store(acc_out_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)
    else:
        out = acc / tl.where(sums > 0, sums, 1.0)[:, None]
        ptrs = out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    seq_lens_ptr,
    rows_ptr,
    window,
    stride_ot,
    stride_oh,
    num_heads,
    num_parts,
    PARTITION: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """One program per (sequence, query head): the log-sum-exp merge of its partitions."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Partitions count from the window start (seq_len - window, or 0).
    context = tl.minimum(seq_len, window) if WINDOWED else seq_len
    used = tl.cdiv(context, PARTITION)
    base = (seq.to(tl.int64) * num_heads + head) * num_parts
    parts = tl.arange(0, PARTS_PAD)
    part_ok = parts < used
    m_parts = tl.load(m_ptr + base + parts, mask=part_ok, other=float("-inf"))
    l_parts = tl.load(l_ptr + base + parts, mask=part_ok, other=0.0)
    m = tl.max(m_parts, 0)
    denominator = tl.sum(tl.exp2(m_parts - m) * l_parts, 0)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    numerator = tl.zeros([HEAD_PAD], tl.float32)
    for part in range(0, used):
        weight = tl.exp2(tl.load(m_ptr + base + part) - m)
        numerator += weight * tl.load(acc_ptr + (base + part) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
    row = tl.load(rows_ptr + seq)
    ptrs = out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(ptrs, (numerator / denominator).to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence s owns q-blocks from query_start_loc[s] // BLOCK_Q + s on (enough for its query tokens
    wherever they start), so the grid size needs no host sync; binary search for the owner."""
    # int32 from the start, as vLLM's kernel declares them: loop-carried values must keep one type.
    left: tl.int32 = 0
    right: tl.int32 = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _mixed_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    qk_scale,
    window,
    cap_in,
    cap_out,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_b,
    stride_t,
    stride_h,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INT8_KV: tl.constexpr,
):
    """Row r of a program is query token r // GROUP of its q-block, query head r % GROUP of its KV head.
    WINDOWED: the walk starts at the window start of the program's first token, and each row masks the
    positions before its own."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # cached positions before this step's first query token
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (token < q_len)
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0)
    limit = context + token + 1
    end = context + tl.minimum(q_len, first + BLOCK_Q)
    if WINDOWED:
        lowest = tl.maximum(limit - window, 0)
        start = tl.maximum(context + first + 1 - window, 0)
    else:
        lowest = limit
        start = 0
    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    m, sums, acc = _attend(
        q.to(tl.float32),
        k_ptr,
        v_ptr,
        table_ptr,
        kv_head * stride_h,
        start,
        end,
        lowest,
        limit,
        qk_scale,
        cap_in,
        cap_out,
        stride_b,
        stride_t,
        dims,
        dim_ok,
        BLOCK_M,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_SIZE,
        TILE,
        DOT_PRECISION,
        WINDOWED,
        SOFTCAP,
        INT8_KV,
    )
    out = acc / tl.where(sums > 0, sums, 1.0)[:, None]
    ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_b,
    stride_t,
    stride_h,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    target = (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_t + heads * stride_h + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + target, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + target, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension with stride 1 and take the other strides as given (outputs
    are allocated contiguous)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # One set of strides addresses both caches.
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one [num_blocks, block_size, H_kv, D] layout")


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V `[T, H_kv, D]` at its slot (`block * block_size + offset`); a negative slot is skipped."""
    _check_caches(k_cache, v_cache)
    if key.shape[0] == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _write_kv_kernel[(key.shape[0],)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def decode(
    call: AttentionCall, out: torch.Tensor, *, partition_size: int = DEFAULT_PARTITION_SIZE, version: int | None = None
) -> None:
    """The call's decode rows, one query token per sequence: write into `out[rows[s]]` the attention of
    `query[rows[s]]` over the first `seq_lens[s]` positions of sequence s (its last `window` ones, if > 0).
    `version` 1 or 2 forces a kernel; None applies the rule to the positions walked."""
    k_cache, v_cache, batch = call.k_cache, call.v_cache, call.metadata.decode
    assert batch is not None
    _check_caches(k_cache, v_cache)
    if version not in (None, 1, 2):
        raise ValueError(f"version must be 1, 2 or None, got {version!r}")
    query = _rows_contiguous(call.query)
    block_tables, seq_lens, rows = batch.block_tables, batch.seq_lens, batch.rows
    options = Options(call.window, call.softcap, call.scale)
    max_seq_len = options.context(batch.max_seq_len)
    num_seqs, num_heads = seq_lens.shape[0], query.shape[1]
    version = version or choose_decode_version(max_seq_len, num_seqs, num_heads, partition_size)
    geometry = Geometry.of(query, k_cache)
    query_strides = (query.stride(0), query.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    specialize = {
        "GROUP": geometry.group,
        "GROUP_PAD": geometry.group_pad,
        **geometry.constexprs(),
        **options.constexprs(),
    }
    partitioned = version == 2
    num_parts = triton.cdiv(max_seq_len, partition_size) if partitioned else 1
    # v1 writes `out` directly; its partial-result arguments are never read.
    stats = torch.empty(2, num_seqs, num_heads, num_parts, dtype=torch.float32, device=query.device)
    partial = torch.empty(num_seqs, num_heads, num_parts, geometry.head_dim, dtype=torch.float32, device=query.device)
    _decode_kernel[(num_seqs, k_cache.shape[2], num_parts)](
        out,
        stats[0],
        stats[1],
        partial,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        rows,
        call.scale * LOG2E,
        *options.runtime(),
        *query_strides,
        out.stride(0),
        out.stride(1),
        *cache_strides,
        num_heads,
        num_parts,
        PARTITIONED=partitioned,
        PARTITION=partition_size,
        **specialize,
        num_warps=geometry.decode_num_warps,
    )
    if not partitioned:
        return
    _merge_partitions_kernel[(num_seqs, num_heads)](
        out,
        stats[0],
        stats[1],
        partial,
        seq_lens,
        rows,
        call.window,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_parts,
        PARTITION=partition_size,
        PARTS_PAD=triton.next_power_of_2(num_parts),
        HEAD_DIM=geometry.head_dim,
        HEAD_PAD=geometry.head_pad,
        WINDOWED=call.window > 0,
    )


def mixed(call: AttentionCall, out: torch.Tensor, chunk: PrefillChunk | None = None) -> None:
    """Any flat batch (prefill chunks after cached prefixes, decode tokens: the call's metadata) into `out`,
    causal per sequence; with `chunk`, only that prefill chunk's rows, as a batch of its own."""
    k_cache, v_cache = call.k_cache, call.v_cache
    _check_caches(k_cache, v_cache)
    options = Options(call.window, call.softcap, call.scale)
    rows = slice(None) if chunk is None else chunk.rows
    query, out = _rows_contiguous(call.query[rows]), out[rows]
    batch = call.metadata if chunk is None else chunk
    block_tables, seq_lens, query_start_loc = batch.block_tables, batch.seq_lens, batch.query_start_loc
    geometry = Geometry.of(query, k_cache)
    block_m = max(MIXED_BLOCK_M, triton.next_power_of_2(geometry.group))
    block_q = block_m // geometry.group
    num_seqs = seq_lens.shape[0]
    grid = (query.shape[0] // block_q + num_seqs, k_cache.shape[2])
    _mixed_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        call.scale * LOG2E,
        *options.runtime(),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=geometry.group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        **geometry.constexprs(),
        **options.constexprs(),
        num_warps=MIXED_NUM_WARPS,
    )


def attend(
    call: AttentionCall, *, partition_size: int = DEFAULT_PARTITION_SIZE, version: int | None = None
) -> torch.Tensor:
    """The step's decode tokens in one decode launch (v1 or v2, which `version` may force), each prefill
    chunk in a mixed launch of its own. Every tensor they read was put on the device by the metadata."""
    out = torch.empty(call.query.shape, dtype=call.query.dtype, device=call.query.device)
    call = replace(call, window=max(int(call.window), 0), softcap=max(float(call.softcap), 0.0))
    if call.metadata.decode is not None:
        decode(call, out, partition_size=partition_size, version=version)
    for chunk in call.metadata.prefills:
        mixed(call, out, chunk)
    return out
