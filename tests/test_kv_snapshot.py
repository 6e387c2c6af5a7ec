"""`LLM.kv_snapshot()` and the KV events, under real load: a tiny model on a small pool with forks (n > 1),
prefix-cache hits and preemption by recompute and by swap, stepped by hand and checked after every step."""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventFile
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.kv.prefix_hash import ROOT_HASH, hash_blocks
from pagedllm.outputs import KVSnapshot
from pagedllm.sequence import SequenceStatus
from tests.kv_invariants import check_kv_invariants

BLOCK_SIZE = 4
SHARED_PREFIX = list(range(10, 34))  # six full blocks every prompt starts with: prefix-cache hits


def loaded_llm(tiny_llama, mode: str) -> LLM:
    """A pool small enough that the requests below preempt each other."""
    options = {"block_size": BLOCK_SIZE, "num_kv_blocks": 48, "preemption_mode": mode, "swap_space": 0.01}
    return LLM(model=tiny_llama, dtype="float32", **options)


def add_load(llm: LLM, seed: int) -> None:
    rng = random.Random(seed)
    for index in range(8):
        prompt = SHARED_PREFIX + [rng.randrange(40, 300) for _ in range(rng.randrange(3, 12))]
        params = SamplingParams(n=3 if index % 2 else 1, temperature=1.0, seed=index, max_tokens=24, ignore_eos=True)
        llm.engine.add_request(f"r{index}", prompt, params)


def check_snapshot(llm: LLM, snapshot: KVSnapshot) -> None:
    engine = llm.engine
    assert snapshot.num_blocks == len(snapshot.ref_counts) == llm.stats().kv_blocks_total
    assert snapshot.block_size == BLOCK_SIZE
    assert snapshot.kv_utilization == llm.stats().kv_utilization
    # Every block's count is its number of block-table entries; no held block is reported free.
    entries = Counter(block for seq in snapshot.sequences for block in seq.block_table if block >= 0)
    assert snapshot.ref_counts == [entries.get(block, 0) for block in range(snapshot.num_blocks)]
    assert sum(1 for count in snapshot.ref_counts if count) == llm.stats().kv_blocks_used
    pool = engine.scheduler.kv.pool
    assert sorted(snapshot.cached) == sorted(pool.cached.values())
    assert all(pool.block_hash[block] is not None for block in snapshot.cached)
    # The sequences are exactly the live ones, each as the scheduler holds it.
    live = {seq.seq_id: seq for group in engine.requests.values() for seq in group.live_seqs()}
    assert {seq.seq_id for seq in snapshot.sequences} == set(live)
    swapped = Counter(block for seq in snapshot.sequences for block in seq.swapped_blocks)
    assert snapshot.swapped_out_blocks == len(swapped) == llm.stats().num_swapped_out_blocks
    for seq in snapshot.sequences:
        state = live[seq.seq_id]
        assert seq.request_id == state.request_id
        assert seq.status == state.status.name.lower()
        assert seq.num_cached_tokens == state.num_computed_tokens
        if seq.status == "swapped":
            assert not seq.block_table and len(seq.swapped_blocks) * BLOCK_SIZE >= seq.num_cached_tokens
        else:
            assert not seq.swapped_blocks
            assert len(seq.block_table) * BLOCK_SIZE >= seq.num_cached_tokens
        if state.status is SequenceStatus.WAITING:
            assert seq.num_cached_tokens == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_snapshot_after_every_step_agrees_with_the_pool_and_the_tables(tiny_llama, mode):
    llm = loaded_llm(tiny_llama, mode)
    add_load(llm, seed=1)
    seen: Counter[str] = Counter()
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
        snapshot = llm.kv_snapshot()
        assert snapshot.step == steps
        check_snapshot(llm, snapshot)
        check_kv_invariants(llm.engine.scheduler.kv)
        seen.update(seq.status for seq in snapshot.sequences)
        seen["shared"] += any(count > 1 for count in snapshot.ref_counts)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and seen["shared"] > 0
    assert seen["swapped" if mode == "swap" else "waiting"] > 0
    final = llm.kv_snapshot()
    assert final.sequences == [] and not any(final.ref_counts) and final.kv_utilization == 0.0
    assert json.loads(json.dumps(final.as_dict()))["num_blocks"] == final.num_blocks


def test_an_abort_shows_at_once(tiny_llama):
    llm = loaded_llm(tiny_llama, "recompute")
    add_load(llm, seed=2)
    llm.engine.step()
    held = llm.kv_snapshot()
    assert any(held.ref_counts)
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)
    after = llm.kv_snapshot()
    assert not any(after.ref_counts) and after.sequences == []
    assert set(after.cached) == set(held.cached)  # freed blocks stay findable


def test_snapshot_of_100k_blocks_is_cheap():
    """The block side at the size the page must handle: a full pool of 100,000 blocks, every block cached."""
    kv = KVCacheManager(100_000, 16, num_cpu_blocks=1_000)
    tokens = list(range(16 * 100))
    for seq_id in range(1_000):
        kv.allocate_slots(seq_id, 0, len(tokens), [])
        kv.register_computed(seq_id, [seq_id, *tokens[1:]], len(tokens))
    kv.snapshot()
    started = time.perf_counter()
    for _ in range(10):
        snapshot = kv.snapshot()
    cost = (time.perf_counter() - started) / 10
    assert len(snapshot.ref_counts) == 100_000 and len(snapshot.cached) == 100_000
    assert cost < 0.02, f"a snapshot of 100,000 blocks took {cost * 1e3:.1f} ms"


class Recorder:
    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)


def test_kv_events_mirror_the_prefix_cache(tiny_llama, tmp_path):
    """Replaying the events rebuilds exactly the set of hashes the prefix cache can find."""
    llm = loaded_llm(tiny_llama, "recompute")
    recorder, jsonl = Recorder(), tmp_path / "events.jsonl"
    writer = KVEventFile(jsonl)
    llm.engine.add_kv_event_sink(recorder)
    llm.engine.add_kv_event_sink(writer)
    mirror: set[bytes] = set()
    for seed in range(3):
        add_load(llm, seed)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            for event in recorder.events:
                replay(mirror, event)
            recorder.events.clear()
            assert mirror == set(llm.engine.scheduler.kv.pool.cached)
    llm.reset_prefix_cache()
    llm.engine.remove_kv_event_sink(writer)
    writer.close()
    assert recorder.events == [AllBlocksCleared()]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    kinds = Counter(line["type"] for line in lines)
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0 and kinds["AllBlocksCleared"] == 1
    assert all(isinstance(line["ts"], float) for line in lines)


def test_block_stored_carries_the_chain(tiny_llama):
    """The first stored block has no parent; each event's tokens rebuild its hashes from its parent."""
    llm = LLM(model=tiny_llama, dtype="float32", block_size=BLOCK_SIZE)
    recorder = Recorder()
    llm.engine.add_kv_event_sink(recorder)
    llm.generate([SHARED_PREFIX + [7, 8]], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    stored = [event for event in recorder.events if isinstance(event, BlockStored)]
    assert stored[0].parent_block_hash is None
    for event in stored:
        parent = event.parent_block_hash or ROOT_HASH
        count = len(event.block_hashes)
        assert len(event.token_ids) == count * BLOCK_SIZE == count * event.block_size
        assert hash_blocks(event.token_ids, BLOCK_SIZE, None, 0, count, parent) == event.block_hashes
    llm.engine.remove_kv_event_sink(recorder)
    assert llm.engine.scheduler.kv.pool.events is None


def replay(mirror: set[bytes], event: KVEvent) -> None:
    if isinstance(event, BlockStored):
        assert not mirror & set(event.block_hashes)
        mirror.update(event.block_hashes)
    elif isinstance(event, BlockRemoved):
        assert set(event.block_hashes) <= mirror
        mirror.difference_update(event.block_hashes)
    else:
        mirror.clear()
