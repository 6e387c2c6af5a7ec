"""The obviously-correct paged attention: one query token at a time, in float32. Kept for tests."""

import torch

from pagedllm.attention.metadata import AttentionMetadata


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence, read through its block-table row: [length, H_kv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(length)
    blocks = block_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def attend(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    starts, lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        keys = gather_sequence(k_cache, metadata.block_tables[s], seq_len).float().repeat_interleave(group, dim=1)
        values = gather_sequence(v_cache, metadata.block_tables[s], seq_len).float().repeat_interleave(group, dim=1)
        for j in range(end - start):
            visible = seq_len - (end - start) + j + 1
            q = query[start + j].float()  # [H, D]
            scores = torch.einsum("hd,lhd->hl", q, keys[:visible]) * scale
            weights = torch.softmax(scores, dim=-1)
            out[start + j] = torch.einsum("hl,lhd->hd", weights, values[:visible]).to(query.dtype)
    return out
