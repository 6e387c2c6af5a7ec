"""Which blocks belong to which sequence: block tables, copy-on-write, forks, prefix caching, swap.

Everything here is bookkeeping over block ids; the copies and swaps it decides are returned as
(source, destination) pairs that the worker carries out on the tensors before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.events import BlockStored, KVEvent, KVEventSink
from pagedllm.kv.prefix_hash import ROOT_HASH, hash_blocks

BlockPair = tuple[int, int]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class SeqBlocks:
    """One sequence's hold on the pools, freed as one: its table and what prefix caching knows of it."""

    blocks: list[int] = field(default_factory=list)  # GPU/CPU-pool ids in order; CPU swap ids when swapped
    num_tokens: int = 0  # tokens whose slots the table holds
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its registered full blocks
    salt: str | None = None
    lora_id: int | None = None  # the adapter its K/V are computed under, reported with its stored blocks
    swapped: bool = False
    # Leading entries given back because every layer's sliding window has passed them; they read -1.
    num_slid: int = 0

    @property
    def held(self) -> list[int]:
        return self.blocks[self.num_slid :]


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The block side of a KV snapshot: copies, so the engine may go on while a reader looks at it."""

    block_size: int
    num_blocks: int
    ref_counts: list[int]  # per block: the block-table entries pointing at it (0 = free)
    cached: list[int]  # blocks the prefix cache can find, held or free, in no particular order
    num_cpu_blocks: int
    swapped_out_blocks: int  # CPU blocks in use; which ones each sequence holds is in its own table
    kv_utilization: float


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_window: int = 0,
    ) -> None:
        """`sliding_window` > 0: every layer attends to at most that many positions back, so blocks that
        all of a sequence's next queries have slid past go back to the pool (as in vLLM v1)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.seqs: dict[int, SeqBlocks] = {}
        self.num_cow_copies = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._sinks: list[KVEventSink] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_to_hold(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens`, computed `max_chunk` tokens a step at most, holds
        at once. With a sliding window: its window plus one chunk (and a block boundary)."""
        if self.sliding_window:
            num_tokens = min(num_tokens, self.sliding_window + max_chunk + self.block_size)
        return blocks_needed(num_tokens, self.block_size)

    # ---- a sequence's life ----------------------------------------------------------------

    def start_sequence(self, seq_id: int, token_ids: list[int], salt: str | None, lora_id: int | None = None) -> int:
        """Open a block table holding the longest cached prefix of `token_ids`; returns the number of
        tokens it covers. Never the last token: its logits must still be computed. `salt` keys the first block's
        hash (the adapter's key is in it); `lora_id` is what the KV events say of the blocks."""
        blocks, hashes = self._lookup(token_ids, salt)
        for block in blocks:
            self.pool.take(block)
        self.seqs[seq_id] = SeqBlocks(blocks, len(blocks) * self.block_size, hashes, salt, lora_id)
        return len(blocks) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _lookup(self, token_ids: list[int], salt: str | None) -> tuple[list[int], list[bytes]]:
        if not self.enable_prefix_caching:
            return [], []
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        for index in range((len(token_ids) - 1) // self.block_size):
            (block_hash,) = hash_blocks(token_ids, self.block_size, salt, index, index + 1, parent)
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
            hashes.append(block_hash)
            parent = block_hash
        return blocks, hashes

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int, copies: list[BlockPair]) -> bool:
        """Make room to write tokens `num_computed .. num_computed+num_new-1`. The block the first
        of them lands in may be shared (after a fork): it is copied first, and the copy is appended
        to `copies`. False, with nothing changed, if the pool is short."""
        record = self.seqs.setdefault(seq_id, SeqBlocks())
        if self.sliding_window:
            self._slide(record, num_computed)
        table = record.blocks
        first = num_computed // self.block_size
        shared = first < len(table) and self.pool.ref_counts[table[first]] > 1
        missing = max(blocks_needed(num_computed + num_new, self.block_size) - len(table), 0)
        if missing + shared > self.pool.num_free:
            return False
        if shared:
            (copy,) = self.pool.allocate(1)
            copies.append((table[first], copy))
            self.pool.free([table[first]])
            table[first] = copy
            self.num_cow_copies += 1
        if missing:
            table.extend(self.pool.allocate(missing))
        record.num_tokens = num_computed + num_new
        return True

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Keep the slots of the first `num_tokens` tokens only: the blocks past them (speculation's rejected
        guesses wrote there) go back to the pool. They were allocated for this sequence alone and never
        registered, so no other table holds them and the prefix cache cannot find them."""
        record = self.seqs[seq_id]
        keep = max(blocks_needed(num_tokens, self.block_size), record.num_slid)
        if keep < len(record.blocks):
            self.pool.free(record.blocks[keep:])
            del record.blocks[keep:]
        record.num_tokens = num_tokens

    def _slide(self, record: SeqBlocks, num_computed: int) -> None:
        """Free the blocks wholly before the window of the next query (at position `num_computed`): it
        sees positions from num_computed - window + 1 on. They stay findable by the prefix cache."""
        num_slid = min(max(num_computed - self.sliding_window + 1, 0) // self.block_size, len(record.blocks))
        if num_slid > record.num_slid:
            self.pool.free(record.blocks[record.num_slid : num_slid])
            record.blocks[record.num_slid : num_slid] = [-1] * (num_slid - record.num_slid)
            record.num_slid = num_slid

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; the first write into a shared block copies it."""
        record = self.seqs[parent_id]
        for block in record.held:
            self.pool.take(block)
        self.seqs[child_id] = replace(record, blocks=list(record.blocks), hashes=list(record.hashes))

    def register_computed(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Make the sequence's newly completed full blocks findable by later prompts."""
        record = self.seqs.get(seq_id)
        if not self.enable_prefix_caching or record is None:
            return
        hashes = record.hashes
        full = num_computed // self.block_size
        if full <= len(hashes):
            return
        first = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        new = hash_blocks(token_ids, self.block_size, record.salt, first, full, parent)
        stored = [self.pool.register(record.blocks[first + i], block_hash) for i, block_hash in enumerate(new)]
        hashes.extend(new)
        if self._sinks:
            self._report_stored(token_ids, record, first, stored)

    def _report_stored(self, token_ids: list[int], record: SeqBlocks, first: int, stored: list[bool]) -> None:
        """One BlockStored per run of consecutive newly registered blocks (`stored[i]`: block `first + i` was). A
        block that another sequence registered first is not stored again, and breaks the run."""
        size, hashes = self.block_size, record.hashes
        start = None
        for index, is_new in enumerate([*stored, False], start=first):
            if is_new and start is None:
                start = index
            elif not is_new and start is not None:
                parent = hashes[start - 1] if start else None
                tokens = token_ids[start * size : index * size]
                self._emit(BlockStored(hashes[start:index], parent, tokens, size, record.lora_id))
                start = None

    def free(self, seq_id: int) -> None:
        record = self.seqs.pop(seq_id, None)
        if record is not None and record.held:
            pool = self.cpu_pool if record.swapped else self.pool
            assert pool is not None
            pool.free(record.held)

    def block_table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].blocks

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    # ---- events -----------------------------------------------------------------------------

    def add_event_sink(self, sink: KVEventSink) -> None:
        """Report prefix-cache changes (`kv/events.py`) to `sink`, on the thread that drives this manager."""
        self._sinks.append(sink)
        self.pool.events = self._emit

    def remove_event_sink(self, sink: KVEventSink) -> None:
        self._sinks.remove(sink)
        if not self._sinks:
            self.pool.events = None  # nobody listens: the pool builds no events at all

    def _emit(self, event: KVEvent) -> None:
        for sink in self._sinks:
            sink(event)

    # ---- swapping -------------------------------------------------------------------------

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        if self.cpu_pool is None:
            return False
        return len(self._distinct(seq_ids)) <= self.cpu_pool.num_free

    def swap_out(self, seq_ids: list[int]) -> list[BlockPair]:
        """Move the blocks of these sequences (shared ones once) to CPU blocks; frees the pool blocks."""
        assert self.cpu_pool is not None
        return self._move(seq_ids, self.pool, self.cpu_pool, swapped=True)

    def blocks_to_swap_in(self, seq_ids: list[int]) -> int:
        return len(self._distinct(seq_ids))

    def swap_in(self, seq_ids: list[int]) -> list[BlockPair]:
        assert self.cpu_pool is not None
        return self._move(seq_ids, self.cpu_pool, self.pool, swapped=False)

    def _distinct(self, seq_ids: list[int]) -> list[int]:
        return _distinct(self.seqs[s].held for s in seq_ids if s in self.seqs)

    def _move(self, seq_ids: list[int], src: BlockPool, dst: BlockPool, swapped: bool) -> list[BlockPair]:
        """Re-home the tables of `seq_ids` from one pool to the other, each distinct block once."""
        records = [self.seqs.setdefault(seq_id, SeqBlocks()) for seq_id in seq_ids]
        distinct = _distinct(record.held for record in records)
        mapping = dict(zip(distinct, dst.allocate(len(distinct)), strict=True))
        holders = dict.fromkeys(mapping.values(), 0)
        for record in records:
            src.free(record.held)
            record.blocks[record.num_slid :] = [mapping[block] for block in record.held]
            record.swapped = swapped
            for block in record.held:
                holders[block] += 1
        for block, count in holders.items():  # allocate gave one reference; each further holder takes one more
            for _ in range(count - 1):
                dst.take(block)
        return list(mapping.items())

    # ---- numbers --------------------------------------------------------------------------

    def utilization(self) -> float:
        """Tokens stored over the slots of the blocks that hold them: the η of the PagedAttention paper.
        A token in a shared block counts once per sequence that reads it, so sharing can push η above 1."""
        used = self.pool.num_used
        live = [record for record in self.seqs.values() if not record.swapped]
        held = sum(record.num_tokens - record.num_slid * self.block_size for record in live)
        return held / (used * self.block_size) if used and held else 0.0

    def snapshot(self) -> PoolSnapshot:
        """Copies of the pool's state, for a reader on another thread. O(num_blocks) in list copies only."""
        pool, cpu_pool = self.pool, self.cpu_pool
        return PoolSnapshot(
            block_size=self.block_size,
            num_blocks=pool.num_blocks,
            ref_counts=pool.ref_counts.copy(),
            cached=list(pool.cached.values()),
            num_cpu_blocks=cpu_pool.num_blocks if cpu_pool else 0,
            swapped_out_blocks=cpu_pool.num_used if cpu_pool else 0,
            kv_utilization=self.utilization(),
        )

    def blocks_saved_by_sharing(self) -> int:
        tables = [record.held for record in self.seqs.values() if not record.swapped]
        return sum(len(t) for t in tables) - len(_distinct(tables))


def _distinct(tables) -> list[int]:
    return list(dict.fromkeys(block for table in tables for block in table))
