"""The obviously-correct paged attention: one query token at a time, in float32. Kept for tests.

The sliding window and soft-capping of `AttentionCall` follow Hugging Face transformers' own code
(`masking_utils.sliding_window_causal_mask_function`, Gemma 2's `eager_attention_forward`)."""

import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionCall


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Positions `start..length` of one sequence, read through its block-table row: [length - start, H_kv, D]
    in float32 (dequantized from an int8 cache). Only the entries of the blocks holding those positions are
    read."""
    block_size = cache.shape[1]
    positions = torch.arange(start, length)
    blocks = block_row.long()[positions // block_size]
    return kv_quant.as_float(cache[blocks, positions % block_size])


def attend(call: AttentionCall) -> torch.Tensor:
    query, metadata, window, softcap = call.query, call.metadata, call.window, call.softcap
    out = torch.empty_like(query)
    group = query.shape[1] // call.k_cache.shape[2]
    starts, lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        # Read only from the window start of the sequence's first query token: blocks before it may be freed.
        first_position = seq_len - (end - start)
        lowest = max(0, first_position - window + 1) if window > 0 else 0
        table = metadata.block_tables[s]
        keys = gather_sequence(call.k_cache, table, seq_len, lowest).repeat_interleave(group, dim=1)
        values = gather_sequence(call.v_cache, table, seq_len, lowest).repeat_interleave(group, dim=1)
        for j in range(end - start):
            position = first_position + j
            visible_from = max(0, position - window + 1) if window > 0 else 0
            q = query[start + j].float()  # [H, D]
            seen = slice(visible_from - lowest, position + 1 - lowest)
            scores = torch.einsum("hd,lhd->hl", q, keys[seen]) * call.scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=-1)
            out[start + j] = torch.einsum("hl,lhd->hd", weights, values[seen]).to(query.dtype)
    return out
