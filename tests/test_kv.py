"""The block pool and KV cache manager on their own: allocation, freeing, accounting, utilization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedllm.kv.block_pool import BlockPool, NoFreeBlocksError
from pagedllm.kv.kv_cache_manager import KVCacheManager
from tests.kv_invariants import check_kv_invariants


def test_pool_allocates_distinct_blocks_and_refuses_overdraw():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4 and pool.peak_used == 3


def test_double_free_is_an_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="not referenced"):
        pool.free(blocks)


def test_freed_blocks_are_reused_oldest_first_and_chain_tail_first():
    pool = BlockPool(4)
    first = pool.allocate(2)
    second = pool.allocate(2)
    pool.free(first)
    pool.free(second)
    assert pool.allocate(4) == [first[1], first[0], second[1], second[0]]


def test_slots_grow_block_by_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    copies: list = []
    assert kv.allocate_slots(7, 0, 5, copies)
    assert len(kv.block_table(7)) == 2
    assert kv.allocate_slots(7, 5, 3, copies)
    assert len(kv.block_table(7)) == 2
    assert kv.allocate_slots(7, 8, 1, copies)
    assert len(kv.block_table(7)) == 3 and copies == []
    assert kv.utilization() == pytest.approx(9 / 12)


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots(1, 0, 8, [])
    assert not kv.allocate_slots(2, 0, 8, [])
    assert not kv.seqs[2].blocks
    assert kv.pool.num_free == 1
    check_kv_invariants(kv)


def test_random_workload_keeps_every_block_accounted_for():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    lengths: dict[int, int] = {}
    for _ in range(2000):
        seq = rng.randrange(12)
        if seq in lengths and rng.random() < 0.2:
            kv.free(seq)
            del lengths[seq]
        else:
            target = lengths.get(seq, 0) + rng.randint(1, 6)
            if kv.allocate_slots(seq, lengths.get(seq, 0), target - lengths.get(seq, 0), []):
                lengths[seq] = target
        check_kv_invariants(kv)
        assert kv.pool.num_free + kv.pool.num_used == 40
        assert all(len(kv.block_table(s)) == -(-n // 4) for s, n in lengths.items())
    for seq in list(lengths):
        kv.free(seq)
    assert kv.pool.num_free == 40


def test_kv_pool_tensors_start_zeroed_in_the_documented_layout():
    # Padded positions are weighted by exactly 0 in attention; 0 x garbage (NaN) would poison outputs.
    import torch

    from pagedllm.worker.cache_engine import CacheEngine, KVShape

    shape = KVShape(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.bfloat16)
    cache = CacheEngine(shape, num_blocks=5)
    assert len(cache.kv_caches) == 2
    for k, v in cache.kv_caches:
        assert k.shape == v.shape == (5, 4, 3, 8) and k.dtype == torch.bfloat16
        assert not k.any() and not v.any()
        # Stored head-major: one KV head's rows of a block are contiguous (strides of block, position, head).
        assert k.stride() == v.stride() == (3 * 4 * 8, 8, 4 * 8, 1)


def test_kv_pool_is_on_base_pages_and_marked_so():
    """The pool's mapping is advised base pages (huge ones cost 4-6x more to fault in); the advice is also
    how `bench soak` tells the pool from the rest of a server's memory."""
    import torch

    from pagedllm.worker.cache_engine import zeroed

    pool = zeroed((64, 16, 3, 64), torch.bfloat16, "cpu")
    address, flags = pool.data_ptr(), None
    start = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            start = low if low <= address < high else None
        elif head == "VmFlags:" and start is not None:
            flags = set(line.split()[1:])
            break
    assert flags is not None, "the pool's mapping is in smaps"
    assert "nh" in flags and "hg" not in flags


def test_sliding_window_gives_back_blocks_every_query_has_passed():
    """Window 8, blocks of 4: decoding a 200-token sequence holds at most 8 / 4 + 1 blocks at a time (plus
    the one being written), and the blocks it gave back stay findable by the prefix cache."""
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=8)
    tokens = list(range(200))
    assert kv.allocate_slots(1, 0, 12, [])  # a 12-token prompt: nothing has slid yet
    kv.register_computed(1, tokens, 12)
    held = []
    for position in range(12, 200):
        assert kv.allocate_slots(1, position, 1, [])
        kv.register_computed(1, tokens, position + 1)
        check_kv_invariants(kv)
        held.append(len(kv.seqs[1].held))
        # The next query (at `position`) sees positions position - 7 .. position: its blocks are all held.
        first_needed = (position - 7) // 4
        assert kv.seqs[1].num_slid <= first_needed
        assert all(block >= 0 for block in kv.block_table(1)[first_needed:])
    assert max(held) <= 8 // 4 + 2
    assert kv.pool.num_used == len(kv.seqs[1].held)
    # A new prompt with the same first 40 tokens finds their blocks again, slid or not.
    kv.free(1)
    assert kv.start_sequence(2, tokens[:41], None) == 40


def test_sliding_window_forks_and_swaps_only_the_blocks_held():
    kv = KVCacheManager(num_blocks=32, block_size=4, num_cpu_blocks=32, sliding_window=4)
    assert kv.allocate_slots(1, 0, 20, [])
    assert kv.allocate_slots(1, 20, 1, [])  # the query at 20 sees 17..20: blocks 0-3 slide
    assert kv.seqs[1].num_slid == 4
    kv.fork(1, 2)
    check_kv_invariants(kv)
    moved = kv.swap_out([1, 2])
    assert len(moved) == len(kv.seqs[1].held) == 2  # shared blocks move once
    check_kv_invariants(kv)
    kv.swap_in([1, 2])
    check_kv_invariants(kv)
    assert kv.block_table(2)[:4] == [-1] * 4
    kv.free(1)
    kv.free(2)
    assert kv.pool.num_used == 0
