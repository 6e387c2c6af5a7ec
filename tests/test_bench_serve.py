"""`pagedllm bench serve` against a live tiny server: every field of the report, with values that agree with
each other and with vLLM's definitions."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import numpy as np
import pytest
from matplotlib.image import imread

from pagedllm.benchmarks.serve import poisson_offsets
from pagedllm.cli import main
from tests.test_server import ServerProcess, start_server, stop_server

NUM_PROMPTS = 8
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    process = start_server(tiny_llama, log, "--served-model-name", "tiny")
    yield process
    assert stop_server(process) == 0, log.read_text()


def bench(server: ServerProcess, tmp_path, *flags: str) -> tuple[int, dict]:
    path = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", str(NUM_PROMPTS), "--input-len", "16"]
    argv += ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", str(path), *flags]
    return main(argv), json.loads(path.read_text())


def test_report_has_every_field_with_consistent_values(server, tmp_path, capsys):
    returncode, report = bench(server, tmp_path, "--request-rate", "inf")
    assert returncode == 0
    assert (report["completed"], report["failed"], report["model"]) == (NUM_PROMPTS, 0, "tiny")
    assert report["total_output_tokens"] == NUM_PROMPTS * MAX_TOKENS  # the server's own count, via usage
    assert report["total_input_tokens"] >= NUM_PROMPTS * 16  # at least a token per word
    duration = report["duration"]
    assert report["request_throughput"] == pytest.approx(NUM_PROMPTS / duration)
    assert report["output_throughput"] == pytest.approx(NUM_PROMPTS * MAX_TOKENS / duration)
    total = report["total_input_tokens"] + report["total_output_tokens"]
    assert report["total_token_throughput"] == pytest.approx(total / duration)
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, median, std, p99 = (report[f"{stat}_{name}_ms"] for stat in ("mean", "median", "std", "p99"))
        assert mean > 0 and median > 0 and std >= 0 and p99 >= median
    assert report["mean_e2el_ms"] <= duration * 1000
    # vLLM's TPOT: (e2e - ttft) / (output tokens - 1) per request; every request has MAX_TOKENS tokens.
    expected_e2el = report["mean_ttft_ms"] + (MAX_TOKENS - 1) * report["mean_tpot_ms"]
    assert report["mean_e2el_ms"] == pytest.approx(expected_e2el)
    # Every request's TTFT and TPOT, in seconds, behind the summary and the CDF plot beside the JSON.
    assert len(report["ttfts_s"]) == len(report["tpots_s"]) == NUM_PROMPTS
    assert 1000 * np.mean(report["ttfts_s"]) == pytest.approx(report["mean_ttft_ms"])
    assert 1000 * np.percentile(report["tpots_s"], 99) == pytest.approx(report["p99_tpot_ms"])
    plot = tmp_path / "latency_cdf.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and imread(plot).shape[:2] == (400, 1000)
    table = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Output token throughput (tok/s):", "P99 TTFT (ms):", "Mean ITL (ms):"):
        assert line in table


def test_failed_requests_are_counted_and_explained(server, tmp_path):
    returncode, report = bench(server, tmp_path, "--request-rate", "inf", "--model", "no-such-model")
    assert returncode == 1
    assert (report["completed"], report["failed"]) == (0, NUM_PROMPTS)
    assert "HTTP 404" in report["first_error"] and "no-such-model" in report["first_error"]


def test_arrivals_are_a_poisson_process():
    offsets = poisson_offsets(20_000, 50.0, random.Random(0))
    gaps = [later - earlier for earlier, later in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0 and min(gaps) >= 0
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 50.0, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    std = (sum((gap - mean) ** 2 for gap in gaps) / len(gaps)) ** 0.5
    assert std == pytest.approx(mean, rel=0.05)
    assert poisson_offsets(5, float("inf"), random.Random(0)) == [0.0] * 5


def test_warmups_run_first_and_are_not_measured(server, tmp_path):
    before = server.metric("pagedllm:generation_tokens_total")
    returncode, report = bench(server, tmp_path, "--num-warmups", "4")
    assert returncode == 0 and report["num_warmups"] == 4
    assert report["completed"] == NUM_PROMPTS and report["total_output_tokens"] == NUM_PROMPTS * MAX_TOKENS
    generated = server.metric("pagedllm:generation_tokens_total") - before
    assert generated == (NUM_PROMPTS + 4) * MAX_TOKENS  # the server did serve the warm-ups


def test_cold_measures_the_same_burst_again_warm_and_their_ratio(server, tmp_path, capsys):
    before = server.metric("pagedllm:generation_tokens_total")
    returncode, report = bench(server, tmp_path, "--cold")
    assert returncode == 0 and report["cold"]
    warm = report["warm"]
    assert report["completed"] == warm["completed"] == NUM_PROMPTS
    assert report["total_output_tokens"] == warm["total_output_tokens"] == NUM_PROMPTS * MAX_TOKENS
    assert report["cold_over_warm"] == pytest.approx(report["output_throughput"] / warm["output_throughput"])
    assert server.metric("pagedllm:generation_tokens_total") - before == 2 * NUM_PROMPTS * MAX_TOKENS
    assert "Cold over warm:" in capsys.readouterr().out


def test_cold_takes_no_warmups(server, tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", server.url, "--cold", "--num-warmups", "2"]
    assert main(argv) == 2
    assert "--cold measures a server's first requests" in capsys.readouterr().err
