"""The attention contract and the CPU path the engine runs.

Every sequence of a step (decode tokens, prompts, chunks after cached tokens) goes to the C kernel in
`native` in one call per layer: K/V read in place through the block table, no copies, an online softmax
in chunks of 16 positions, bf16 pairs multiplied by AVX512-BF16 where the CPU has it. On the 2-core
machine this was tuned on (bf16, SmolLM2's 9 heads / 3 KV heads / head dim 64): about 1.1 ms per layer
for 111 sequences of 290 tokens from cold caches, and 0.45 ms for a 258-token prompt (torch's fused
causal kernel took 1.6 ms). Where it cannot be built, a torch fallback gathers whole blocks into reused
buffers (a fresh allocation per layer costs 3x in page faults), scores grouped heads as one batched
matmul against a block-diagonal query (`matmul` on permuted heads copies), and pads length-sorted groups
of 16; a prompt that is its whole context uses this step's K/V directly in torch's fused causal kernel,
and a chunk after cached tokens reads its prefix from the cache. Scores and softmax are float32
everywhere. Everything that depends only on block tables and lengths is computed once per step in an
`AttentionPlan` and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention import native
from pagedllm.attention.reference import reference_attention

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


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one query token each, of similar lengths, attended as one padded batch."""

    token_index: torch.Tensor  # [S] rows of the flat batch
    block_ids: torch.Tensor  # [S * max_blocks] (padding points at block 0 and is masked out)
    invalid: torch.Tensor  # [S, max_blocks * block_size, 1] True past each sequence's end


@dataclass(slots=True)
class DecodeBatch:
    """Every sequence with exactly one query token this step."""

    token_index: torch.Tensor  # [S] int64 rows of the flat batch
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    block_size: int
    _groups: list[DecodeGroup] | None = None

    def groups(self) -> list[DecodeGroup]:
        """The torch path's length-sorted padded groups, built on first use and shared by all layers."""
        if self._groups is None:
            lens = self.seq_lens.tolist()
            order = sorted(range(len(lens)), key=lens.__getitem__)
            self._groups = [
                _plan_group(self, order[i : i + DECODE_GROUP_SIZE]) for i in range(0, len(order), DECODE_GROUP_SIZE)
            ]
        return self._groups


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with several query tokens (a prefill chunk, maybe after cached tokens)."""

    query_start: int
    query_end: int
    block_ids: torch.Tensor  # [num_blocks]
    seq_len: int

    @property
    def is_whole_context(self) -> bool:
        """All of its context is in this step's batch, so this step's K/V can be used directly."""
        return self.query_end - self.query_start == self.seq_len


@dataclass(slots=True)
class StepTables:
    """The whole step's metadata as the C kernel reads it: int32 and contiguous."""

    block_tables: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S]
    query_start_loc: torch.Tensor  # [S + 1]


@dataclass(slots=True)
class AttentionPlan:
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]
    workspace: Workspace
    tables: StepTables


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot (`block * block_size + offset`); a negative slot is padding."""
    if k_cache.is_cuda:
        from pagedllm.attention import triton_ops  # imported on first GPU use: triton is optional

        triton_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
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
    workspace: Workspace | None = None,
) -> AttentionPlan:
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    decode = None
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.long)
        decode = DecodeBatch(
            token_index=query_start_loc[rows].long(),
            block_tables=block_tables[rows].int().contiguous(),
            seq_lens=seq_lens[rows].int().contiguous(),
            block_size=block_size,
        )
    prefills = [
        PrefillSeq(starts[s], starts[s + 1], block_tables[s, : -(-lens[s] // block_size)].long(), lens[s])
        for s in range(len(lens))
        if starts[s + 1] - starts[s] > 1
    ]
    tables = StepTables(
        block_tables.int().contiguous(), seq_lens.int().contiguous(), query_start_loc.int().contiguous()
    )
    return AttentionPlan(decode, prefills, workspace or Workspace(), tables)


def _plan_group(batch: DecodeBatch, rows: list[int]) -> DecodeGroup:
    index = torch.tensor(rows, dtype=torch.long)
    group_lens = batch.seq_lens[index].long()
    max_blocks = -(-int(group_lens.max()) // batch.block_size)
    block_ids = batch.block_tables[index, :max_blocks].reshape(-1).long()
    invalid = torch.arange(max_blocks * batch.block_size)[None, :] >= group_lens[:, None]
    return DecodeGroup(batch.token_index[index], block_ids, invalid[:, :, None])


def run_planned(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention for the flat batch. `key`/`value`, when given, are this step's (already written to
    the cache): a prompt that is its whole context then attends to them without a gather."""
    if query.is_cuda:
        from pagedllm.attention import triton_ops

        return triton_ops.run_planned(query, k_cache, v_cache, plan, scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if native.supports(query, k_cache):
        tables = plan.tables
        native.paged_attention(
            query, k_cache, v_cache, tables.block_tables, tables.seq_lens, tables.query_start_loc, out, scale
        )
        return out
    if plan.decode is not None:
        for group in plan.decode.groups():
            out[group.token_index] = _attend_decode(query, k_cache, v_cache, group, plan.workspace, scale)
    for seq in plan.prefills:
        rows = slice(seq.query_start, seq.query_end)
        if seq.is_whole_context and key is not None and value is not None:
            out[rows] = _attend_causal(query[rows], key[rows], value[rows], scale)
        else:
            out[rows] = _attend_after_prefix(query[rows], k_cache, v_cache, seq, scale)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.index_select(cache, 0, block_ids, out=out)


def _attend_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    workspace: Workspace,
    scale: float,
) -> torch.Tensor:
    num_seqs, padded_len = group.invalid.shape[0], group.invalid.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    shape = (group.block_ids.numel(), block_size, num_kv_heads, head_dim)
    keys = _gather(k_cache, group.block_ids, workspace.take("k", shape, k_cache)).view(num_seqs, padded_len, -1)
    values = _gather(v_cache, group.block_ids, workspace.take("v", shape, v_cache)).view(num_seqs, padded_len, -1)
    q = query.index_select(0, group.token_index)  # [S, H, D]
    if num_kv_heads <= MAX_KV_HEADS_BLOCK_DIAGONAL:
        return _decode_block_diagonal(q, keys, values, group.invalid, num_kv_heads, scale)
    return _decode_per_kv_head(q, keys, values, group.invalid, num_kv_heads, scale)


def _decode_block_diagonal(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, invalid: torch.Tensor, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """keys/values `[S, L, H_kv*D]` as stored. Each query head is placed in the rows of its KV head
    (zeros elsewhere), so one batched matmul scores all heads on contiguous memory."""
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    grouped = q.view(num_seqs, num_kv_heads, group, head_dim)
    block_q = q.new_zeros(num_seqs, num_kv_heads, head_dim, num_kv_heads, group)
    for kv_head in range(num_kv_heads):
        block_q[:, kv_head, :, kv_head, :] = grouped[:, kv_head].transpose(1, 2)
    scores = torch.bmm(keys.float(), block_q.view(num_seqs, -1, num_heads).float()).mul_(scale)  # [S, L, H]
    scores.masked_fill_(invalid, float("-inf"))
    weights = torch.softmax(scores, dim=1)
    mixed = torch.bmm(weights.transpose(1, 2), values.float()).to(
        q.dtype
    )  # [S, H, H_kv*D]: keep each head's own KV head
    mixed = mixed.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    return torch.diagonal(mixed, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(num_seqs, num_heads, head_dim)


def _decode_per_kv_head(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, invalid: torch.Tensor, num_kv_heads: int, scale: float
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    grouped = q.view(num_seqs, num_kv_heads, group, head_dim)
    keys = keys.view(num_seqs, -1, num_kv_heads, head_dim)
    values = values.view(num_seqs, -1, num_kv_heads, head_dim)
    out = q.new_empty(num_seqs, num_kv_heads, group, head_dim)
    mask = invalid.view(num_seqs, 1, -1)
    for kv_head in range(num_kv_heads):
        scores = torch.bmm(grouped[:, kv_head].float(), keys[:, :, kv_head].transpose(1, 2).float()).mul_(scale)
        scores.masked_fill_(mask, float("-inf"))
        out[:, kv_head] = torch.bmm(torch.softmax(scores, dim=-1), values[:, :, kv_head].float())
    return out.view(num_seqs, num_heads, head_dim)


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt (chunk) that is its own whole context: plain causal attention on this step's K/V.
    Inputs get a batch dimension because only 4-D inputs reach torch's fused CPU kernel (2x faster)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _attend_after_prefix(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    """A chunk after tokens already in the cache: query j sits at position seq_len - q_len + j."""
    q_len = query.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    keys = k_cache.index_select(0, seq.block_ids).view(-1, num_kv_heads, head_dim)[: seq.seq_len]
    values = v_cache.index_select(0, seq.block_ids).view(-1, num_kv_heads, head_dim)[: seq.seq_len]
    q = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    scores = torch.matmul(q.float(), keys.permute(1, 2, 0).float()).mul_(scale).view(num_kv_heads, group, q_len, -1)
    key_positions = torch.arange(seq.seq_len)
    query_positions = torch.arange(seq.seq_len - q_len, seq.seq_len)
    scores.masked_fill_(key_positions[None, :] > query_positions[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, -1)
    out = torch.matmul(weights, values.transpose(0, 1).float()).view(num_kv_heads * group, q_len, head_dim)
    return out.transpose(0, 1).to(query.dtype)


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

    `backend` defaults to "triton" for CUDA tensors and "cpu" otherwise. `partition_size` (default 512)
    belongs to the Triton decode kernels: the context length of one v2 partition, and an input of the
    v1/v2 choice. The CPU paths attend to the whole context at once, which is exact, so they ignore it.
    """
    backend = backend or ("triton" if query.is_cuda else "cpu")
    if backend == "triton":
        from pagedllm.attention import triton_ops

        partition_size = partition_size or triton_ops.DEFAULT_PARTITION_SIZE
        args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        return triton_ops.paged_attention(*args, partition_size=partition_size)
    if backend == "reference":
        return reference_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if backend != "cpu":
        raise ValueError(f"backend must be 'reference', 'cpu' or 'triton', got {backend!r}")
    plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return run_planned(query, None, None, k_cache, v_cache, plan, scale)
