"""The block manager's invariants, checked by tests after every change they make."""

from __future__ import annotations

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.kv_cache_manager import KVCacheManager


def check_kv_invariants(kv: KVCacheManager) -> None:
    """Every block's ref count equals the number of tables holding it; free iff unreferenced; the
    prefix-cache map and the blocks' hashes agree. Swapped tables are checked against the CPU pool."""
    _check_pool(kv.pool, [record.held for record in kv.seqs.values() if not record.swapped])
    if kv.cpu_pool is not None:
        _check_pool(kv.cpu_pool, [record.held for record in kv.seqs.values() if record.swapped])
    for record in kv.seqs.values():
        assert record.blocks[: record.num_slid] == [-1] * record.num_slid, "slid entries must read -1"
        assert all(block >= 0 for block in record.held), "only the leading entries may have slid"


def _check_pool(pool: BlockPool, tables: list[list[int]]) -> None:
    holders = [0] * pool.num_blocks
    for table in tables:
        for block in table:
            holders[block] += 1
    for block, count in enumerate(holders):
        assert pool.ref_counts[block] == count, f"block {block}: ref count {pool.ref_counts[block]}, held {count}"
        assert (count == 0) == pool.is_free(block), f"block {block}: free={pool.is_free(block)} with {count} holders"
    for block_hash, block in pool.cached.items():
        assert pool.block_hash[block] == block_hash, f"block {block}: cache map and block hash disagree"
