"""The torch fallback, for machines where the C kernel cannot be built: it reads K/V through the block
table with torch ops, everything in float32 scores and softmax.

Decode tokens are padded into length-sorted groups of 16 sequences; each group's blocks are gathered whole
into buffers reused across layers and steps (a fresh allocation per layer pays its page faults again), and
its grouped heads are scored as one batched matmul against a block-diagonal query (`matmul` on permuted
heads copies). A prefill chunk reads its whole context from the cache and applies a causal mask.

With a sliding window, each sequence's blocks are gathered from the block holding the window start of its
first query token (the blocks before it may be freed: their table entries are never read), and the
positions before each query's window are masked; soft-capping is applied to the scaled scores.

An int8 cache's gathered blocks are dequantized to float32 (`kv_quant`) before the products."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionCall, AttentionMetadata, DecodeRows, PrefillChunk

DECODE_GROUP_SIZE = 16
# Above this many KV heads the block-diagonal product wastes too many multiplications;
# attend one KV head at a time instead.
MAX_KV_HEADS_BLOCK_DIAGONAL = 4


class Workspace:
    """Gather buffers kept across layers and steps, so their pages are faulted in only once."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


# One per process: the engine runs one step at a time, and every layer of a step fits the same buffers.
_WORKSPACE = Workspace()


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one query token each, of similar lengths, attended as one padded batch."""

    token_index: torch.Tensor  # [S] rows of the flat batch
    block_ids: torch.Tensor  # [S * max_blocks] (padding points at block 0 and is masked out)
    invalid: torch.Tensor  # [S, max_blocks * block_size, 1] True before each one's window and past its end


def window_start(position: int, window: int) -> int:
    """The first position a query at `position` sees."""
    return max(0, position - window + 1) if window > 0 else 0


def decode_groups(metadata: AttentionMetadata, window: int = 0) -> list[DecodeGroup]:
    """The step's decode sequences, sorted by how many blocks they read and cut into padded groups."""
    batch = metadata.decode
    if batch is None:
        return []
    lens, block_size = batch.seq_lens.tolist(), metadata.block_size
    first_blocks = [window_start(n - 1, window) // block_size for n in lens]
    counts = [-(-n // block_size) - first for n, first in zip(lens, first_blocks, strict=True)]
    order = sorted(range(len(lens)), key=counts.__getitem__)
    return [
        _group(batch, order[i : i + DECODE_GROUP_SIZE], block_size, window)
        for i in range(0, len(order), DECODE_GROUP_SIZE)
    ]


def _group(batch: DecodeRows, rows: list[int], block_size: int, window: int) -> DecodeGroup:
    index = torch.tensor(rows, dtype=torch.long)
    group_lens = batch.seq_lens[index].long()
    if window <= 0:
        max_blocks = -(-int(group_lens.max()) // block_size)
        block_ids = batch.block_tables[index, :max_blocks].reshape(-1).long()
        invalid = torch.arange(max_blocks * block_size)[None, :] >= group_lens[:, None]
        return DecodeGroup(batch.rows[index].long(), block_ids, invalid[:, :, None])
    # Each sequence's blocks from the one holding its window start: the entries before it are never read.
    starts = (group_lens - window).clamp_min(0)
    first_blocks = starts // block_size
    counts = (group_lens + block_size - 1) // block_size - first_blocks
    max_blocks = int(counts.max())
    columns = first_blocks[:, None] + torch.arange(max_blocks)[None, :]
    used = columns < (first_blocks + counts)[:, None]
    tables = batch.block_tables[index].long()
    block_ids = torch.where(used, tables.gather(1, torch.where(used, columns, 0)), 0).reshape(-1)
    positions = first_blocks[:, None] * block_size + torch.arange(max_blocks * block_size)[None, :]
    invalid = (positions < starts[:, None]) | (positions >= group_lens[:, None])
    return DecodeGroup(batch.rows[index].long(), block_ids, invalid[:, :, None])


def attend(call: AttentionCall) -> torch.Tensor:
    out = torch.empty(call.query.shape, dtype=call.query.dtype, device=call.query.device)
    window = max(int(call.window), 0)
    groups = call.metadata.derived(f"torch_decode_groups/{window}", lambda m: decode_groups(m, window))
    for group in groups:
        out[group.token_index] = _attend_decode(call, group)
    for chunk in call.metadata.prefills:
        out[chunk.rows] = _attend_chunk(call, chunk)
    return out


def _cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Soft-capping of scaled scores in place: s -> softcap * tanh(s / softcap) (off at 0)."""
    if softcap > 0:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _attend_decode(call: AttentionCall, group: DecodeGroup) -> torch.Tensor:
    num_seqs, padded_len = group.invalid.shape[0], group.invalid.shape[1]
    shape = (group.block_ids.numel(), *call.k_cache.shape[1:])
    keys = torch.index_select(call.k_cache, 0, group.block_ids, out=_WORKSPACE.take("k", shape, call.k_cache))
    values = torch.index_select(call.v_cache, 0, group.block_ids, out=_WORKSPACE.take("v", shape, call.v_cache))
    if kv_quant.is_int8(keys):
        keys, values = kv_quant.dequantize(keys), kv_quant.dequantize(values)
    num_kv_heads = call.k_cache.shape[2]
    keys, values = keys.view(num_seqs, padded_len, -1), values.view(num_seqs, padded_len, -1)
    q = call.query.index_select(0, group.token_index)  # [S, H, D]
    if num_kv_heads <= MAX_KV_HEADS_BLOCK_DIAGONAL:
        return _decode_block_diagonal(q, keys, values, group.invalid, call)
    return _decode_per_kv_head(q, keys, values, group.invalid, call)


def _decode_block_diagonal(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, invalid: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    """keys/values `[S, L, H_kv*D]` as stored. Each query head is placed in the rows of its KV head
    (zeros elsewhere), so one batched matmul scores all heads on contiguous memory."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, scale, softcap = call.k_cache.shape[2], call.scale, call.softcap
    group = num_heads // num_kv_heads
    grouped = q.view(num_seqs, num_kv_heads, group, head_dim)
    block_q = q.new_zeros(num_seqs, num_kv_heads, head_dim, num_kv_heads, group)
    for kv_head in range(num_kv_heads):
        block_q[:, kv_head, :, kv_head, :] = grouped[:, kv_head].transpose(1, 2)
    scores = torch.bmm(keys.float(), block_q.view(num_seqs, -1, num_heads).float()).mul_(scale)  # [S, L, H]
    _cap(scores, softcap).masked_fill_(invalid, float("-inf"))
    weights = torch.softmax(scores, dim=1)
    # [S, H, H_kv*D]: keep each head's own KV head
    mixed = torch.bmm(weights.transpose(1, 2), values.float()).to(q.dtype)
    mixed = mixed.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    return torch.diagonal(mixed, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(num_seqs, num_heads, head_dim)


def _decode_per_kv_head(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, invalid: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, scale, softcap = call.k_cache.shape[2], call.scale, call.softcap
    group = num_heads // num_kv_heads
    grouped = q.view(num_seqs, num_kv_heads, group, head_dim)
    keys = keys.view(num_seqs, -1, num_kv_heads, head_dim)
    values = values.view(num_seqs, -1, num_kv_heads, head_dim)
    out = q.new_empty(num_seqs, num_kv_heads, group, head_dim)
    mask = invalid.view(num_seqs, 1, -1)
    for kv_head in range(num_kv_heads):
        scores = torch.bmm(grouped[:, kv_head].float(), keys[:, :, kv_head].transpose(1, 2).float()).mul_(scale)
        _cap(scores, softcap).masked_fill_(mask, float("-inf"))
        out[:, kv_head] = torch.bmm(torch.softmax(scores, dim=-1), values[:, :, kv_head].float())
    return out.view(num_seqs, num_heads, head_dim)


def _rows(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of gathered blocks as `[length, H_kv, D]`, int8 ones dequantized."""
    rows = blocks.view(-1, *blocks.shape[2:])[:length]
    return kv_quant.dequantize(rows) if kv_quant.is_int8(rows) else rows


def _attend_chunk(call: AttentionCall, chunk: PrefillChunk) -> torch.Tensor:
    """A chunk's query j sits at position seq_len - q_len + j (after the cached tokens, if any). With a
    window, its context is read from the block holding the first query's window start."""
    query, window, scale = call.query[chunk.rows], call.window, call.scale
    q_len, seq_len = query.shape[0], chunk.seq_len
    block_size, num_kv_heads, head_dim = call.k_cache.shape[1], call.k_cache.shape[2], query.shape[2]
    group = query.shape[1] // num_kv_heads
    first_block = window_start(seq_len - q_len, window) // block_size
    lowest = first_block * block_size
    block_ids = chunk.block_tables[0, first_block : -(-seq_len // block_size)]
    keys = _rows(call.k_cache.index_select(0, block_ids), seq_len - lowest)
    values = _rows(call.v_cache.index_select(0, block_ids), seq_len - lowest)
    q = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    scores = torch.matmul(q.float(), keys.permute(1, 2, 0).float()).mul_(scale).view(num_kv_heads, group, q_len, -1)
    key_positions = torch.arange(lowest, seq_len)
    query_positions = torch.arange(seq_len - q_len, seq_len)
    hidden = key_positions[None, :] > query_positions[:, None]
    if window > 0:
        hidden |= key_positions[None, :] <= query_positions[:, None] - window
    _cap(scores, call.softcap).masked_fill_(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, -1)
    out = torch.matmul(weights, values.transpose(0, 1).float()).view(num_kv_heads * group, q_len, head_dim)
    return out.transpose(0, 1).to(query.dtype)
