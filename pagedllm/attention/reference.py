"""The obviously-correct paged attention: one query token at a time, in float32. Kept for tests."""

import torch


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence, read through its block-table row: [length, H_kv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(length)
    blocks = block_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def reference_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        keys = gather_sequence(k_cache, block_tables[s], seq_len).float().repeat_interleave(group, dim=1)
        values = gather_sequence(v_cache, block_tables[s], seq_len).float().repeat_interleave(group, dim=1)
        for j in range(end - start):
            visible = seq_len - (end - start) + j + 1
            q = query[start + j].float()  # [H, D]
            scores = torch.einsum("hd,lhd->hl", q, keys[:visible]) * scale
            weights = torch.softmax(scores, dim=-1)
            out[start + j] = torch.einsum("hl,lhd->hd", weights, values[:visible]).to(query.dtype)
    return out
