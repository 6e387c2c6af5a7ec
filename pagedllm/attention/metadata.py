"""What every attention layer of one step reads: the step's block tables and lengths, built once per step
on the device the layers run on, one layer's call on them (`AttentionCall`), and the one call every backend
answers to (`Backend`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

import torch

T = TypeVar("T")


@dataclass(slots=True)
class DecodeRows:
    """Every sequence with exactly one query token this step: the batch of the decode kernels."""

    rows: torch.Tensor  # [D] int32 row of each one's query token in the flat batch
    block_tables: torch.Tensor  # [D, max_blocks] int32
    seq_lens: torch.Tensor  # [D] int32
    max_seq_len: int


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with several query tokens (a prompt chunk, maybe after cached tokens), as a batch of
    its own: its block-table row, its length, and query rows 0..q_len of `query[rows]`."""

    rows: slice  # its query tokens in the flat batch
    block_tables: torch.Tensor  # [1, max_blocks] int32
    seq_lens: torch.Tensor  # [1] int32
    query_start_loc: torch.Tensor  # [2] int32: 0, q_len
    seq_len: int


@dataclass(slots=True)
class AttentionMetadata:
    """A flat batch of S sequences: sequence s has query tokens `query_start_loc[s]..query_start_loc[s + 1]`,
    the last ones of its `seq_lens[s]` positions, whose K/V sit in the blocks of `block_tables[s]`. Every
    tensor is int32, contiguous and on the layers' device, so no layer copies or syncs."""

    block_tables: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S]
    query_start_loc: torch.Tensor  # [S + 1]
    block_size: int
    decode: DecodeRows | None
    prefills: list[PrefillChunk]
    _derived: dict[str, object] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """From the scheduler's int32 CPU tensors: what a layer reads goes to `device` here, once a step."""
        tables, lens, starts = (
            t.to(device=device, dtype=torch.int32).contiguous() for t in (block_tables, seq_lens, query_start_loc)
        )
        host_lens, host_starts = seq_lens.tolist(), query_start_loc.tolist()
        query_lens = [host_starts[s + 1] - host_starts[s] for s in range(len(host_lens))]
        decode_seqs = [s for s, q_len in enumerate(query_lens) if q_len == 1]
        decode = None
        if decode_seqs:
            index = torch.tensor(decode_seqs, dtype=torch.long, device=device)
            max_seq_len = max(host_lens[s] for s in decode_seqs)
            decode = DecodeRows(starts[index], tables[index], lens[index], max_seq_len)
        prefill_seqs = [s for s, q_len in enumerate(query_lens) if q_len > 1]
        # One tensor (one copy to the device) holds every chunk's query_start_loc.
        chunk_starts = torch.tensor([[0, query_lens[s]] for s in prefill_seqs], dtype=torch.int32, device=device)
        prefills = [
            PrefillChunk(
                slice(host_starts[s], host_starts[s + 1]),
                tables[s : s + 1],
                lens[s : s + 1],
                chunk_starts[i],
                host_lens[s],
            )
            for i, s in enumerate(prefill_seqs)
        ]
        return cls(tables, lens, starts, block_size, decode, prefills)

    def derived(self, name: str, build: Callable[[AttentionMetadata], T]) -> T:
        """What one backend derives from the metadata, built by its first layer and reused by the rest."""
        if name not in self._derived:
            self._derived[name] = build(self)
        return cast(T, self._derived[name])


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One layer's attention over a step, what every backend module's `attend` takes: query `[T, H, D]`
    rows, that layer's caches `[num_blocks, block_size, H_kv, D]`, the step's metadata and the layer's
    scale; the result is `[T, H, D]`. Token j of sequence s sits at position p = `seq_lens[s] - q_len + j`
    and attends causally to positions 0..p, or with a sliding `window` W > 0 to p - W < j' <= p only;
    `softcap` c > 0 turns each scaled logit s into c * tanh(s / c) before the mask and the softmax (both as
    Hugging Face transformers computes them; 0 turns either off). With a window, no backend reads a
    block-table entry of a block that lies wholly before the window start of its sequence's first query
    token of the step: the engine frees those blocks, and their entries may be -1."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float
    window: int = 0
    softcap: float = 0.0


class Backend(Protocol):
    """The call every attention backend answers, the fields of an `AttentionCall` (`get_backend` wraps each
    backend module's `attend(call)` in it)."""

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...
