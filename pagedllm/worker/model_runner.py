"""Turns the scheduled sequences into one flat token batch, runs the model, returns logits of the sampling rows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.models.decoder import CausalLM, StepContext
from pagedllm.models.encoder import Encoder
from pagedllm.models.lora import LoRABatch
from pagedllm.sequence import Sequence
from pagedllm.step import ScheduledSeq

_PROMPT_LOGITS_ROWS = 256


@dataclass(slots=True)
class PromptRows:
    """Rows of the flat batch whose logits score the prompt's next token, for sequences that asked for
    prompt log-probabilities: `spans` says whose they are, in order, as (sequence, number of rows)."""

    index: torch.Tensor  # [P] rows of the flat batch
    targets: torch.Tensor  # [P] the prompt token each row predicts
    spans: list[tuple[Sequence, int]]


@dataclass(slots=True)
class PoolRows:
    """Rows of the flat batch whose hidden states pooling sequences pool this step (`Pooler.part`): each one's
    whole chunk for mean pooling, its first position for CLS, its last for last-token pooling, in `spans`' order
    as (sequence, number of rows, whether the chunk completes it: a classifier's head reads that row)."""

    index: torch.Tensor  # [R] rows of the flat batch
    spans: list[tuple[Sequence, int, bool]]


@dataclass(slots=True)
class RunOutput:
    logits: torch.Tensor  # [sampling rows, vocab] float32, on the CPU
    prompt_hidden: torch.Tensor | None  # the hidden states of the batch's prompt rows
    pool_hidden: torch.Tensor | None  # the hidden states of the batch's pool rows


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    # Rows whose hidden state picks a token, in `scheduled` order: a sequence's last, or with drafts its last
    # len(drafts) + 1 (the sequence's last token's, then each draft's).
    logits_index: torch.Tensor
    prompt: PromptRows | None  # rows scoring prompt tokens, when some sequence asked for them
    pool: PoolRows | None = None  # rows pooled into pooling sequences' vectors
    lora: LoRABatch | None = None  # rows under LoRA adapters, by slot
    token_type_ids: torch.Tensor | None = None  # [T], an encoder's, when some sequence has them (others: 0)


def build_batch(scheduled: list[ScheduledSeq], block_size: int, lora_slots: dict[int, int] | None = None) -> FlatBatch:
    """The step's flat batch; `lora_slots` maps each scheduled adapter's id to its slot (None: no adapters)."""
    batch = _flat_batch(scheduled, block_size)
    if lora_slots:
        slot_of_seq = [-1 if item.seq.lora is None else lora_slots[item.seq.lora.lora_int_id] for item in scheduled]
        batch.lora = LoRABatch.build(slot_of_seq, [item.num_new_tokens for item in scheduled])
    return batch


def _flat_batch(scheduled: list[ScheduledSeq], block_size: int) -> FlatBatch:
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for item in scheduled:
        start, end = item.start, item.start + item.num_new_tokens
        ids.extend(item.input_ids)
        pos = np.arange(start, end, dtype=np.int64)
        positions.append(pos)
        slots.append(slots_of(item.block_table, pos, block_size))
        query_lens.append(item.num_new_tokens)
        seq_lens.append(end)
    query_start = np.concatenate(([0], np.cumsum(query_lens)))
    logits_rows = [
        row
        for i, item in enumerate(scheduled)
        if item.samples
        for row in range(int(query_start[i + 1]) - 1 - item.num_drafts, int(query_start[i + 1]))
    ]
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.from_numpy(np.concatenate(positions)),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        block_tables=pad_tables([item.block_table for item in scheduled]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)),
        logits_index=torch.tensor(logits_rows, dtype=torch.long),
        prompt=_prompt_rows(scheduled, query_start),
        pool=_pool_rows(scheduled, query_start),
        token_type_ids=_token_types(scheduled),
    )


def _token_types(scheduled: list[ScheduledSeq]) -> torch.Tensor | None:
    if all(item.seq.token_type_ids is None for item in scheduled):
        return None
    types: list[int] = []
    for item in scheduled:
        given = item.seq.token_type_ids
        end = item.start + item.num_new_tokens
        types.extend([0] * item.num_new_tokens if given is None else given[item.start : end])
    return torch.tensor(types, dtype=torch.long)


def _pool_rows(scheduled: list[ScheduledSeq], query_start: np.ndarray) -> PoolRows | None:
    index: list[int] = []
    spans: list[tuple[Sequence, int, bool]] = []
    for i, item in enumerate(scheduled):
        pool = item.seq.pool
        if pool is None:
            continue
        first, end = int(query_start[i]), int(query_start[i + 1])
        kind = pool.pooler.pooling_type
        if kind == "mean":
            rows = range(first, end)
        elif kind == "cls":
            rows = range(first, first + 1) if item.start == 0 else range(0)
        else:
            rows = range(end - 1, end) if item.completes else range(0)
        if rows:
            index.extend(rows)
            spans.append((item.seq, len(rows), item.completes))
    if not spans:
        return None
    return PoolRows(torch.tensor(index), spans)


def _prompt_rows(scheduled: list[ScheduledSeq], query_start: np.ndarray) -> PromptRows | None:
    """Positions p of this step with prompt token p + 1 still unscored: the hidden state at p predicts it.
    Positions scored before a preemption are not scored again."""
    index: list[int] = []
    targets: list[int] = []
    spans: list[tuple[Sequence, int]] = []
    for i, item in enumerate(scheduled):
        seq = item.seq
        if not seq.num_prompt_logprobs_missing:
            continue
        first = max(item.start, len(seq.prompt_logprobs))
        last = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)  # exclusive
        if first >= last:
            continue
        offset = int(query_start[i]) - item.start
        index.extend(range(offset + first, offset + last))
        targets.extend(seq.token_ids[first + 1 : last + 1])
        spans.append((seq, last - first))
    if not spans:
        return None
    return PromptRows(torch.tensor(index), torch.tensor(targets), spans)


def slots_of(block_table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slots of a sequence's token positions, through its block table."""
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return torch.from_numpy(padded)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM | Encoder,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device | str,
    ):
        self.model = model
        self.kv_caches = kv_caches  # none for an encoder
        self.block_size = block_size
        self.device = torch.device(device)
        self.attention = get_backend(None, self.device)

    @torch.inference_mode()
    def run(self, batch: FlatBatch) -> RunOutput:
        """Float32 logits `[len(batch.logits_index), vocab]`, on the CPU where the sampler runs; and the hidden
        states of `batch.prompt`'s and `batch.pool`'s rows, if any."""
        hidden = self._forward(batch)
        logits = torch.empty(0, self.model.config.vocab_size)  # a step of pooling sequences only samples nothing
        if len(batch.logits_index):
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_index.to(self.device))).cpu()
        prompt_hidden = None if batch.prompt is None else hidden.index_select(0, batch.prompt.index.to(self.device))
        pool_hidden = None if batch.pool is None else hidden.index_select(0, batch.pool.index.to(self.device))
        return RunOutput(logits, prompt_hidden, pool_hidden)

    @torch.inference_mode()
    def fill(self, batch: FlatBatch) -> None:
        """Only the K/V of the batch's tokens (a draft model's, beside its target's step)."""
        self._forward(batch)

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        if isinstance(self.model, Encoder):  # whole prompts, attending among themselves: no cache, no metadata
            types = None if batch.token_type_ids is None else batch.token_type_ids.to(self.device)
            ids, positions = batch.input_ids.to(self.device), batch.positions.to(self.device)
            return self.model(ids, positions, types, batch.query_start_loc.tolist())
        metadata = AttentionMetadata.build(
            batch.block_tables, batch.seq_lens, batch.query_start_loc, self.block_size, self.device
        )
        positions, slot_mapping = batch.positions.to(self.device), batch.slot_mapping.to(self.device)
        lora = None if batch.lora is None else batch.lora.to(self.device)
        ctx = StepContext(positions, slot_mapping, metadata, self.attention, self.kv_caches, lora)
        return self.model(batch.input_ids.to(self.device), ctx)

    @torch.inference_mode()
    def prompt_logits(self, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Float32 logits of the prompt rows' hidden states, on the CPU, a slice at a time (first row, logits):
        a slice bounds the [rows, vocab] temporaries (~50 MB at 256 rows)."""
        for start in range(0, len(hidden), _PROMPT_LOGITS_ROWS):
            yield start, self.model.compute_logits(hidden[start : start + _PROMPT_LOGITS_ROWS]).cpu()
