"""The memory-picture harness: counterfactual allocators on hand-made traces (plain, forked samples, a shared
prefix) with exact η, the workloads' sharing showing up in the numbers, and the command alive."""

from __future__ import annotations

import itertools
import json

import pytest

from pagedllm.benchmarks.memory import (
    VOCAB_SIZE,
    MemoryResult,
    TraceRequest,
    replay_contiguous,
    replay_paged,
    run_all,
    trace_from_workload,
)
from pagedllm.benchmarks.workloads import SHARED_PREFIX_GROUPS, SHARED_PREFIX_LEN, make_workload
from pagedllm.cli import main

_fresh_tokens = itertools.count()


def request(prompt_len: int, output_len: int, n: int = 1) -> TraceRequest:
    """A request whose prompt shares no token with any other, so the prefix cache never hits by accident."""
    return TraceRequest(tuple(itertools.islice(_fresh_tokens, prompt_len)), output_len, n)


# A: prompt 3, 2 output tokens (final length 5); B: prompt 5, 3 output tokens (final length 8).
TRACE = [request(3, 2), request(5, 3)]
# Lengths held step by step: (A 4, B 6), (A 5, B 7), then A leaves and (B 8).
STORED = [10, 12, 8]


@pytest.mark.parametrize(
    ("policy", "reserved"),
    [
        ("orca-max", [32, 32, 16]),  # 16 slots each
        ("orca-pow2", [16, 16, 8]),  # 5 -> 8, 8 -> 8
        ("orca-oracle", [13, 13, 8]),  # 5 + 8
    ],
)
def test_contiguous_allocators_waste_what_they_reserve_ahead(policy, reserved):
    result = replay_contiguous(TRACE, budget=64, policy=policy, max_model_len=16)
    expected = [s / r for s, r in zip(STORED, reserved, strict=True)]
    assert result.utilization == pytest.approx(expected)
    assert result.mean_utilization == pytest.approx(sum(expected) / 3)
    assert result.concurrency == [2, 2, 1] and result.peak_concurrency == 2


def test_paged_allocator_wastes_only_the_last_partial_block():
    result = replay_paged(TRACE, budget=64, block_size=4)
    # Blocks of 4: (1 + 2), (2 + 2), (2) blocks held.
    assert result.utilization == pytest.approx([10 / 12, 12 / 16, 8 / 8])


def test_a_tight_budget_admits_fewer_requests_under_reservation():
    assert replay_contiguous(TRACE, budget=20, policy="orca-max", max_model_len=16).peak_concurrency == 1
    assert replay_contiguous(TRACE, budget=20, policy="orca-oracle", max_model_len=16).peak_concurrency == 2
    assert replay_paged(TRACE, budget=20, block_size=4).peak_concurrency == 2


def test_a_request_larger_than_the_budget_is_refused_not_replayed_forever():
    with pytest.raises(ValueError, match="does not fit"):
        replay_paged([request(6, 48)], budget=32, block_size=4)


def test_paged_allocator_preempts_and_still_finishes_everything():
    trace = [request(6, 10) for _ in range(3)]
    result = replay_paged(trace, budget=32, block_size=4)
    assert result.steps > 10 and all(0 < u <= 1 for u in result.utilization)


def test_forked_samples_share_the_prompt_and_copy_its_partial_block():
    # Prompt 6 in blocks of 4: a full block and one holding 2 tokens. Both samples share them after the fork;
    # the first sample to write copies the partial block, the second then writes into it in place.
    trace = [request(6, 3, n=2)]
    paged = replay_paged(trace, budget=64, block_size=4)
    # Blocks: shared full + 2 partial (3 tokens each) = 3, then both fill up, then each opens a block.
    assert paged.reserved == [12, 12, 20]
    assert paged.stored == [4 + 3 + 3, 4 + 4 + 4, 4 + 2 * (4 + 1)]  # the shared block counted once
    assert paged.utilization == pytest.approx([10 / 12, 1.0, 14 / 20])
    # Contiguous: two regions of the final length 9, each holding its own copy of the prompt.
    oracle = replay_contiguous(trace, budget=64, policy="orca-oracle", max_model_len=16)
    assert oracle.reserved == [18, 18, 18] and oracle.stored == [14, 16, 18]


def test_a_cached_prefix_is_stored_once_for_every_request_reading_it():
    prefix = tuple(range(1000, 1008))  # two full blocks of 4
    trace = [TraceRequest((*prefix, 1), 1), TraceRequest((*prefix, 2), 1)]
    paged = replay_paged(trace, budget=64, block_size=4)
    # One step: the two prefix blocks once, plus each request's own block holding its last prompt token and
    # its first output token.
    assert (paged.reserved, paged.stored, paged.concurrency) == ([16], [8 + 2 + 2], [2])
    oracle = replay_contiguous(trace, budget=64, policy="orca-oracle", max_model_len=16)
    assert (oracle.reserved, oracle.stored) == ([20], [20])


def workload_results(name: str, num_prompts: int, budget: int) -> dict[str, MemoryResult]:
    trace = trace_from_workload(make_workload(name, num_prompts, VOCAB_SIZE, 2048, seed=0), 2048)
    return {r.allocator: r for r in run_all(trace, budget, max_model_len=2048, block_sizes=[16])}


def test_shared_prefix_workload_keeps_each_prefix_once_in_the_paged_allocator():
    results = workload_results("shared-prefix", num_prompts=48, budget=8192)
    paged, oracle = results["paged-16"], results["orca-oracle"]
    assert paged.mean_utilization > oracle.mean_utilization
    assert paged.peak_concurrency > oracle.peak_concurrency
    # Holding its own prefix, each request would need 512 slots of it alone; the paged allocator holds more
    # requests than that allows, with every prefix group running at once.
    peak = paged.concurrency.index(paged.peak_concurrency)
    assert paged.peak_concurrency >= 2 * SHARED_PREFIX_GROUPS
    assert paged.reserved[peak] < paged.peak_concurrency * SHARED_PREFIX_LEN
    assert paged.reserved[peak] >= SHARED_PREFIX_GROUPS * SHARED_PREFIX_LEN  # each of the 8 prefixes, once


def test_parallel_sampling_workload_fits_more_requests_paged_than_contiguous():
    results = workload_results("parallel-n4", num_prompts=24, budget=8192)
    paged = results.pop("paged-16")
    for contiguous in results.values():
        assert paged.mean_utilization > contiguous.mean_utilization, contiguous.allocator
        assert paged.peak_concurrency > contiguous.peak_concurrency, contiguous.allocator
        assert paged.steps < contiguous.steps, contiguous.allocator


def test_beams_are_replayed_as_four_samples_each():
    workload = make_workload("beam4", 3, VOCAB_SIZE, 2048, seed=0)
    trace = trace_from_workload(workload, 2048)
    assert [r.n for r in trace] == [4, 4, 4]
    assert [(r.prompt, r.output_len) for r in trace] == [(r.prompt, r.output_len) for r in workload.requests]


def test_requests_longer_than_the_model_are_left_out():
    workload = make_workload("synthetic", 40, VOCAB_SIZE, 2048, seed=0)
    trace = trace_from_workload(workload, 400)
    assert 0 < len(trace) < 40 and all(r.final_len <= 400 for r in trace)


def test_bench_memory_command_writes_every_series_and_the_plots(tmp_path, capsys):
    out = tmp_path / "memory"
    argv = ["bench", "memory", "--workload", "parallel-n4", "--num-prompts", "12", "--budget", "8192"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "memory.json").read_text())
    assert (report["workload"], report["num_requests"], report["budget"]) == ("parallel-n4", 12, 8192)
    rows = report["results"]
    names = [row["allocator"] for row in rows]
    assert names == ["orca-max", "orca-pow2", "orca-oracle", *(f"paged-{b}" for b in (1, 8, 16, 32, 64, 128))]
    for row in rows:
        assert len(row["stored"]) == len(row["reserved"]) == len(row["concurrency"]) == row["steps"] > 0
        assert row["utilization"] == pytest.approx([s / r for s, r in zip(row["stored"], row["reserved"], strict=True)])
    for name in ("memory_utilization.png", "memory_concurrency.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "parallel-n4: 12 requests x 4 samples" in table and "paged-16" in table


def test_a_sliding_window_lets_the_paged_allocator_hold_more_at_once():
    """Outputs 6x the window: with every layer sliding, each request holds only its window's blocks, so the
    budget that holds one whole request at a time now holds all three."""
    trace = [request(6, 48) for _ in range(3)]
    plain = replay_paged(trace, budget=64, block_size=4)
    windowed = replay_paged(trace, budget=64, block_size=4, sliding_window=8)
    # All three start (their prompts are short); without a window they soon preempt one another.
    assert min(plain.concurrency[:40]) < 3 and min(windowed.concurrency[:40]) == 3
    assert windowed.steps < plain.steps
    assert windowed.allocator == "paged-4-w8" and all(0 < u <= 1 for u in windowed.utilization)
