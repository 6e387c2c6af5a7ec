"""A draft model for speculative decoding: a smaller model with the target's vocabulary, whose K/V live in a pool
of their own indexed by the target's block ids. Every block move (swap, copy-on-write) and every prefix-cache hit
applies to both pools alike, and the draft runs over every flat batch the target runs, so its cache holds the
same tokens as the target's. Before a step it proposes each speculating sequence's guesses greedily, one token a
pass, writing its K/V into the slots the step reserved for them."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.models.decoder import CausalLM
from pagedllm.step import ScheduledSeq
from pagedllm.worker.cache_engine import CacheEngine, KVShape
from pagedllm.worker.model_runner import FlatBatch, ModelRunner, pad_tables, slots_of


class DraftModel:
    def __init__(self, model: CausalLM, shape: KVShape, num_blocks: int, num_cpu_blocks: int, device: str) -> None:
        self.cache = CacheEngine(shape, num_blocks, num_cpu_blocks, device)
        self.runner = ModelRunner(model, self.cache.kv_caches, shape.block_size, device)
        self.block_size = shape.block_size

    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        """Fill each sequence's reserved guesses: pass j feeds the sequence's last token (j = 0) or guess j and
        takes the draft's most likely next token. A sequence whose guesses are there already (a step run again
        after a fault) is left alone: the draft's K/V it wrote are what a second run would write."""
        items = [item for item in scheduled if len(item.draft_token_ids) < item.num_drafts]
        for item in items:
            item.draft_token_ids.clear()  # what a run that raised half-way left
        tokens = [item.seq.token_ids[item.start] for item in items]
        for offset in range(max((item.num_drafts for item in items), default=0)):
            active = [i for i, item in enumerate(items) if item.num_drafts > offset]
            batch = _one_token_each([items[i] for i in active], [tokens[i] for i in active], offset, self.block_size)
            logits = self.runner.run(batch).logits
            for i, token in zip(active, logits.argmax(-1).tolist(), strict=True):
                items[i].draft_token_ids.append(token)
                tokens[i] = token

    def fill(self, batch: FlatBatch) -> None:
        """The draft's K/V of every token of the target's step."""
        self.runner.fill(batch)


def _one_token_each(items: list[ScheduledSeq], tokens: list[int], offset: int, block_size: int) -> FlatBatch:
    """A flat batch of one token per sequence, at position `start + offset`."""
    positions = np.array([item.start + offset for item in items], dtype=np.int64)
    slots = np.concatenate(
        [slots_of(item.block_table, positions[i : i + 1], block_size) for i, item in enumerate(items)]
    )
    count = len(items)
    return FlatBatch(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        block_tables=pad_tables([item.block_table for item in items]),
        seq_lens=torch.from_numpy((positions + 1).astype(np.int32)),
        query_start_loc=torch.arange(count + 1, dtype=torch.int32),
        logits_index=torch.arange(count),
        prompt=None,
    )
