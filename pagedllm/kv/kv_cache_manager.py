"""Which blocks belong to which sequence: block tables, slot reservation, utilization."""

from __future__ import annotations

from pagedllm.kv.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for a sequence to hold `num_tokens` tokens in all; False if the pool is short."""
        table = self.block_tables.setdefault(seq_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing > self.pool.num_free:
            if not table:
                del self.block_tables[seq_id]
            return False
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        self._num_tokens[seq_id] = num_tokens
        return True

    def free(self, seq_id: int) -> None:
        table = self.block_tables.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)
        if table:
            self.pool.free(table)

    def block_table(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id]

    def utilization(self) -> float:
        """Tokens stored over the slots of the blocks that hold them: the η of the PagedAttention paper."""
        used = self.pool.num_used
        if used == 0:
            return 0.0
        return sum(self._num_tokens.values()) / (used * self.block_size)

    def check_invariants(self) -> None:
        """Every block is either free or referenced exactly as often as block tables hold it."""
        holders = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                holders[block] += 1
        for block, count in enumerate(holders):
            if self.pool.ref_counts[block] != count:
                raise AssertionError(f"block {block}: ref count {self.pool.ref_counts[block]}, held {count}")
            if (count == 0) != self.pool.is_free(block):
                raise AssertionError(f"block {block}: free={self.pool.is_free(block)} with {count} holders")
