"""The memory-picture harness: counterfactual allocators on a hand-made trace, and the command alive."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.bench_memory import TraceRequest, replay_contiguous, replay_paged
from pagedllm.entrypoints.cli import main

# A: prompt 3, 2 output tokens (final length 5); B: prompt 5, 3 output tokens (final length 8).
TRACE = [TraceRequest(3, 2), TraceRequest(5, 3)]
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


def test_paged_allocator_preempts_and_still_finishes_everything():
    trace = [TraceRequest(6, 10)] * 3
    result = replay_paged(trace, budget=32, block_size=4)
    assert result.steps > 10 and all(0 < u <= 1 for u in result.utilization)


def test_bench_memory_command_reports_every_allocator(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--num-prompts", "20", "--budget", "8192", "--json", str(out)]) == 0
    names = [row["allocator"] for row in json.loads(out.read_text())]
    assert names == ["orca-max", "orca-pow2", "orca-oracle", *(f"paged-{b}" for b in (1, 8, 16, 32, 64, 128))]
    assert "paged-16" in capsys.readouterr().out
