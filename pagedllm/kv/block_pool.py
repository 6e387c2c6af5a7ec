"""The pool of physical KV blocks: reference counts, an LRU free queue, and the prefix-cache map.
No tensors here."""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, KVEventSink


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids. A block is free when its reference count is 0.

    A free block may still hold a cached full block (its hash maps to it), findable until the
    block is handed out again: eviction is lazy, and the free queue is ordered oldest-freed first
    so the least recently used cached block is evicted first. `OrderedDict` gives O(1) removal
    from the middle, for a cache hit on a free block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.peak_used = 0
        # Set only while someone listens (KVCacheManager.add_event_sink): evictions and resets are reported.
        self.events: KVEventSink | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for block in self._free if self.block_hash[block] is not None)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        evicted = [block_hash for block in blocks if (block_hash := self._evict(block)) is not None]
        for block in blocks:
            self.ref_counts[block] = 1
        if evicted and self.events is not None:
            self.events(BlockRemoved(evicted))
        self._note_peak()
        return blocks

    def take(self, block: int) -> None:
        """One more reference to a block that is in use or cached-and-free (a prefix-cache hit)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
            self._note_peak()
        self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the back of the free queue.

        A sequence's blocks are released tail first so that, among blocks freed together, the
        tail of a chain is evicted before its head (a head is shared by more future prompts).
        """
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed while not referenced")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def is_free(self, block: int) -> bool:
        return block in self._free

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make a full block findable by its hash (first writer wins; duplicates stay unregistered).
        True when it was registered."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def reset_cache(self) -> None:
        if self.num_used:
            raise RuntimeError(f"cannot reset the prefix cache while {self.num_used} blocks are in use")
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.events is not None:
            self.events(AllBlocksCleared())

    def _evict(self, block: int) -> bytes | None:
        """Forget the block's cached contents; returns the hash it had, if any."""
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
        return block_hash

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)
