"""`pagedllm bench soak` against a live server with the default model: a few hundred requests, a share of them
from clients that leave or time out, and the server must end at rest, unharmed and answering the same."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from pagedllm.benchmarks.soak import (
    MISBEHAVIOURS,
    Behaviour,
    SoakConfig,
    SoakResult,
    build_mix,
    format_result,
    parse_metrics,
    run_soak,
)
from pagedllm.cli import main
from pagedllm.models.loader import resolve_model_folder
from tests.test_server import ServerProcess, start_server, stop_server

REQUESTS = 200
CONCURRENCY = 16
WARMUP_REQUESTS = 32  # grows allocators and thread pools to their working size before RSS is read
# The goal. Outside the KV pool (excluded: its pages fault in as fresh blocks are first used, by
# design) the heap once grew ~1 MiB a request, oneDNN keeping a compiled primitive per step size and weight
# shape; its caches are capped now (models/prepack.py) and Python objects and tensors stay flat.
MAX_RSS_GROWTH_MB = 100.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("soak_server") / "server.log"
    process = start_server(resolve_model_folder(None), log)
    yield process
    assert stop_server(process) == 0, log.read_text()


@pytest.fixture(scope="module")
def soak(server) -> SoakResult:
    config = SoakConfig(
        base_url=server.url,
        requests=REQUESTS,
        concurrency=CONCURRENCY,
        seed=0,
        warmup_requests=WARMUP_REQUESTS,
        server_pid=server.process.pid,
        max_rss_growth_mb=MAX_RSS_GROWTH_MB,
    )
    return asyncio.run(run_soak(config))


def test_the_mix_is_fixed_by_the_seed_and_covers_every_kind():
    first, again, other = (build_mix(random.Random(seed), 300, "m") for seed in (0, 0, 1))
    assert first == again and first != other
    bodies = [spec.body for spec in first]
    assert {spec.behaviour for spec in first} == set(Behaviour)
    assert {spec.path for spec in first} == {"/v1/chat/completions", "/v1/completions"}
    assert {spec.stream for spec in first} == {True, False}
    assert {spec.n for spec in first} == {1, 2, 3, 4}
    assert all(1 <= body["max_tokens"] <= 64 for body in bodies)
    assert any("stop" in body for body in bodies)
    assert any(body.get("top_logprobs") is not None for body in bodies)  # chat
    assert any(type(body.get("logprobs")) is int for body in bodies)  # completions
    words = [len((body.get("prompt") or body["messages"][-1]["content"]).split()) for body in bodies]
    assert max(words) >= 150 and sorted(words)[len(words) // 2] <= 24  # a few long prompts, most short
    # Leaving mid-stream needs a stream; timing out is for a whole answer.
    assert all(spec.stream for spec in first if spec.behaviour is Behaviour.LEAVE_MID_STREAM)
    assert not any(spec.stream for spec in first if spec.behaviour is Behaviour.TIME_OUT)


def test_parse_metrics_keys_labelled_samples_as_the_text_spells_them():
    text = '# TYPE pagedllm:requests_finished counter\npagedllm:requests_finished_total{finish_reason="abort"} 3.0\n'
    text += "# TYPE pagedllm:kv_blocks_used gauge\npagedllm:kv_blocks_used 0.0\n"
    metrics = parse_metrics(text)
    assert metrics['pagedllm:requests_finished_total{finish_reason="abort"}'] == 3.0
    assert metrics["pagedllm:kv_blocks_used"] == 0.0


def test_soak_serves_everyone_and_the_server_ends_at_rest(soak, server):
    print(f"\n{format_result(soak)}")
    assert soak.requests == REQUESTS and soak.warmup_requests == WARMUP_REQUESTS
    assert (soak.http_5xx, soak.stream_errors, soak.http_4xx, soak.other_errors) == (0, 0, 0, 0), soak.first_errors
    # Every kind of misbehaviour really happened, or the soak would pass by being polite.
    assert all(soak.disconnects[kind] > 0 for kind in MISBEHAVIOURS), soak.disconnects
    assert soak.served_ok + sum(soak.disconnects.values()) == REQUESTS
    assert soak.server_aborts > 0  # the server saw clients leave and ended their requests
    assert soak.settle.settled, soak.settle.metrics
    assert soak.settle.metrics["pagedllm:num_requests_running"] == 0
    assert soak.settle.metrics["pagedllm:num_requests_waiting"] == 0
    assert soak.settle.metrics["pagedllm:kv_blocks_used"] == 0
    first, second = soak.greedy_answers
    assert first and first == second
    assert 0 < soak.latency_p50_ms <= soak.latency_p99_ms
    assert soak.rss_growth_mib is not None and soak.rss_growth_mib < MAX_RSS_GROWTH_MB
    assert soak.ok, soak.failures
    assert "Traceback" not in server.log.read_text()


def test_cli_soak_prints_the_summary_and_exits_0(server, capsys):
    argv = ["bench", "soak", "--base-url", server.url, "--requests", "10", "--concurrency", "4"]
    argv += ["--warmup-requests", "0", "--seed", "3", "--server-pid", str(server.process.pid)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Soak Result" in out and "Verdict:" in out and "PASS" in out
    assert "Requests sent:" in out and "Server RSS before / after (MiB):" in out
