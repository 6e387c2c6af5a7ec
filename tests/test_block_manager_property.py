"""Stateful property test of the block manager alone: random allocate / append / fork / free /
swap out / swap in / cache hits (evictions happen under allocation pressure), against a model of
what every physical block holds."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.kv.prefix_hash import ROOT_HASH, hash_blocks
from tests.kv_invariants import check_kv_invariants

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_CPU_BLOCKS = 12
# A few shared beginnings, so later prompts find earlier blocks in the cache.
PREFIXES = [[1] * 8, [2, 3] * 6, [4, 5, 6, 7, 8, 9, 10, 11]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.swapped: list[list[int]] = []
        self.content: dict[int, list[int | None]] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.cpu_content: dict[int, list[int | None]] = {}
        self.hash_tokens: dict[bytes, list[int]] = {}
        self.next_id = 0

    # ---- helpers --------------------------------------------------------------------------

    def resident(self) -> list[int]:
        swapped = {sid for group in self.swapped for sid in group}
        return [sid for sid in self.tokens if sid not in swapped]

    def write(self, sid: int, start: int, stop: int) -> None:
        table = self.kv.block_table(sid)
        for pos in range(start, stop):
            block = table[pos // BLOCK_SIZE]
            assert self.kv.pool.ref_counts[block] == 1, f"write into shared block {block}"
            self.content[block][pos % BLOCK_SIZE] = self.tokens[sid][pos]

    def learn_hashes(self, sid: int) -> None:
        full = self.computed[sid] // BLOCK_SIZE
        chain = hash_blocks(self.tokens[sid], BLOCK_SIZE, None, 0, full, ROOT_HASH)
        for index, block_hash in enumerate(chain):
            self.hash_tokens[block_hash] = self.tokens[sid][index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]

    # ---- operations -----------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(20, 30), min_size=1, max_size=9))
    def start(self, prefix: list[int], tail: list[int]) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        tokens = prefix + tail
        hit = self.kv.start_sequence(sid, tokens, None)
        assert hit % BLOCK_SIZE == 0 and hit <= len(tokens) - 1
        for index, block in enumerate(self.kv.block_table(sid)):  # a hit serves exactly these tokens
            assert self.content[block] == tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        self.tokens[sid], self.computed[sid] = tokens, hit

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), count=st.integers(1, 6), new_token=st.integers(20, 30))
    def append(self, data, count: int, new_token: int) -> None:
        sid = data.draw(st.sampled_from(self.resident()))
        if self.computed[sid] == len(self.tokens[sid]):
            self.tokens[sid].append(new_token)  # a generated token, not yet computed
        start = self.computed[sid]
        count = min(count, len(self.tokens[sid]) - start)
        copies: list[tuple[int, int]] = []
        if not self.kv.allocate_slots(sid, start, count, copies):
            assert copies == []
            return
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        self.write(sid, start, start + count)
        self.computed[sid] = start + count
        self.kv.register_computed(sid, self.tokens[sid], self.computed[sid])
        self.learn_hashes(sid)

    @precondition(lambda self: any(self.computed[s] == len(self.tokens[s]) for s in self.resident()))
    @rule(data=st.data())
    def fork(self, data) -> None:
        ready = [s for s in self.resident() if self.computed[s] == len(self.tokens[s])]
        parent = data.draw(st.sampled_from(ready))
        child, self.next_id = self.next_id, self.next_id + 1
        self.kv.fork(parent, child)
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(self.resident()))
        self.kv.free(sid)
        del self.tokens[sid], self.computed[sid]

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        group = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3, unique=True))
        if not self.kv.can_swap_out(group):
            return
        for gpu, cpu in self.kv.swap_out(group):
            self.cpu_content[cpu] = list(self.content[gpu])
        self.swapped.append(group)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        group = data.draw(st.sampled_from(self.swapped))
        if self.kv.blocks_to_swap_in(group) > self.kv.pool.num_free:
            return
        for cpu, gpu in self.kv.swap_in(group):
            self.content[gpu] = list(self.cpu_content[cpu])
        self.swapped.remove(group)

    # ---- what must always hold --------------------------------------------------------------

    @invariant()
    def ref_counts_match_tables_and_free_means_unreferenced(self) -> None:
        check_kv_invariants(self.kv)

    @invariant()
    def every_block_is_accounted_for(self) -> None:
        pool = self.kv.pool
        referenced = sum(1 for count in pool.ref_counts if count > 0)
        cached_free = pool.num_cached_free
        assert (pool.num_free - cached_free) + referenced + cached_free == NUM_BLOCKS
        assert referenced == pool.num_used

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        for block_hash, block in self.kv.pool.cached.items():
            assert self.content[block] == self.hash_tokens[block_hash]

    @invariant()
    def resident_tables_hold_their_computed_tokens(self) -> None:
        for sid in self.resident():
            table = self.kv.block_table(sid)
            for pos in range(self.computed[sid]):
                assert self.content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == self.tokens[sid][pos]


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=200, stateful_step_count=100, deadline=None)
