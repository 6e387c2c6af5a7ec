"""The attention contract and the CPU path the engine runs.

The CPU path reads whole blocks through the block table (one `index_select` of
contiguous blocks is several times faster than gathering slot by slot), then
runs grouped-query attention as two batched matmuls with a float32 softmax.
Everything that depends only on block tables and lengths is computed once per
step in an `AttentionPlan` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.reference import reference_attention


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with exactly one query token this step, attended as one padded batch."""

    token_index: torch.Tensor  # [S] rows of the flat batch
    block_ids: torch.Tensor  # [S, max_blocks] (padding points at block 0, masked out)
    valid: torch.Tensor  # [S, 1, 1, max_blocks * block_size] True where a key position is visible


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with several query tokens (a prefill chunk, maybe after cached tokens)."""

    query_start: int
    query_end: int
    block_ids: torch.Tensor  # [num_blocks]
    seq_len: int

    @property
    def is_plain_causal(self) -> bool:
        return self.query_end - self.query_start == self.seq_len


@dataclass(slots=True)
class AttentionPlan:
    decode: DecodeGroup | None
    prefills: list[PrefillSeq]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot (`block * block_size + offset`); a negative slot is padding."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> AttentionPlan:
    seq_lens_list = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows = [s for s in range(len(seq_lens_list)) if starts[s + 1] - starts[s] == 1]
    prefills = [
        PrefillSeq(
            starts[s], starts[s + 1], _blocks_for(block_tables[s], seq_lens_list[s], block_size), seq_lens_list[s]
        )
        for s in range(len(seq_lens_list))
        if starts[s + 1] - starts[s] > 1
    ]
    decode = _plan_decode(block_tables, seq_lens, starts, decode_rows, block_size) if decode_rows else None
    return AttentionPlan(decode, prefills)


def _blocks_for(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    return block_row[: -(-seq_len // block_size)].long()


def _plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: list[int], rows: list[int], block_size: int
) -> DecodeGroup:
    index = torch.tensor(rows, dtype=torch.long)
    lens = seq_lens.long()[index]
    max_blocks = -(-int(lens.max()) // block_size)
    block_ids = block_tables[index, :max_blocks].long()
    positions = torch.arange(max_blocks * block_size)
    valid = (positions[None, :] < lens[:, None]).view(len(rows), 1, 1, -1)
    token_index = torch.tensor([starts[s] for s in rows], dtype=torch.long)
    return DecodeGroup(token_index, block_ids, valid)


def run_planned(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    if plan.decode is not None:
        out[plan.decode.token_index] = _attend_decode(query, k_cache, v_cache, plan.decode, scale)
    for seq in plan.prefills:
        out[seq.query_start : seq.query_end] = _attend_prefill(query, k_cache, v_cache, seq, scale)
    return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[*block_ids.shape, block_size, H_kv, D] -> flattened to [..., positions, H_kv, D]."""
    gathered = cache.index_select(0, block_ids.reshape(-1))
    return gathered.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def _attend_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    num_seqs = group.block_ids.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q = query.index_select(0, group.token_index).view(num_seqs, num_kv_heads, -1, head_dim)
    keys = _gather_blocks(k_cache, group.block_ids).permute(0, 2, 3, 1)  # [S, H_kv, D, L]
    values = _gather_blocks(v_cache, group.block_ids).transpose(1, 2)  # [S, H_kv, L, D]
    scores = torch.matmul(q, keys).float().mul_(scale)  # [S, H_kv, G, L]
    scores.masked_fill_(~group.valid, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(weights, values).view(num_seqs, -1, head_dim)


def _attend_prefill(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    q_len = seq.query_end - seq.query_start
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q = query[seq.query_start : seq.query_end].transpose(0, 1)  # [H, q_len, D]
    keys = _gather_blocks(k_cache, seq.block_ids)[: seq.seq_len].transpose(0, 1)  # [H_kv, L, D]
    values = _gather_blocks(v_cache, seq.block_ids)[: seq.seq_len].transpose(0, 1)
    if seq.is_plain_causal:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)
    # A chunk after cached tokens: query j sits at position seq_len - q_len + j.
    group = q.shape[0] // num_kv_heads
    q = q.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q, keys.transpose(1, 2)).float().mul_(scale).view(num_kv_heads, group, q_len, -1)
    positions = torch.arange(seq.seq_len)
    query_positions = torch.arange(seq.seq_len - q_len, seq.seq_len)
    scores.masked_fill_(positions[None, :] > query_positions[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(query.dtype).view(num_kv_heads, group * q_len, -1)
    out = torch.matmul(weights, values).view(num_kv_heads * group, q_len, head_dim)
    return out.transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of S sequences through their block tables (see DESIGN.md).

    `partition_size` belongs to the partitioned GPU kernel; the CPU paths attend to the whole
    context at once, which is exact, so they accept and ignore it.
    """
    del partition_size
    backend = backend or "cpu"
    if backend == "reference":
        return reference_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if backend == "cpu":
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
        return run_planned(query, k_cache, v_cache, plan, scale)
    raise ValueError(f"backend must be 'reference' or 'cpu', got {backend!r}")
