"""`pagedllm bench soak` against a live server with the default model: a few hundred requests, a share of them
from clients that leave or time out, and the server must end at rest, unharmed, and have answered every
greedy request of the mix, and a probe before and after, as the offline engine does."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pagedllm.benchmarks.soak import (
    MISBEHAVIOURS,
    Behaviour,
    OfflineEngine,
    Outcome,
    RequestOutcome,
    SoakConfig,
    SoakResult,
    build_mix,
    check_answers,
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
DTYPE = "float32"  # start_server's


@dataclass(frozen=True, slots=True)
class FixedReference:
    """A reference that answers every body with the same text."""

    text: str

    def answers(self, bodies: list[dict]) -> list[str]:
        return [self.text] * len(bodies)


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
        check_answers=REQUESTS,  # every greedy answer of the mix, not a sample
    )
    return asyncio.run(run_soak(config, OfflineEngine(resolve_model_folder(None), DTYPE)))


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


def test_check_answers_spreads_its_sample_over_the_run_and_flags_a_wrong_answer():
    specs = build_mix(random.Random(0), 60, "m")
    outcomes = [RequestOutcome(spec.behaviour, Outcome.OK, texts=("right",) * spec.n) for spec in specs]
    greedy = [i for i, spec in enumerate(specs) if spec.body["temperature"] == 0.0]
    wrong = greedy[-1]
    outcomes[wrong] = RequestOutcome(specs[wrong].behaviour, Outcome.OK, texts=("wrong",) * specs[wrong].n)
    probes, sampled = check_answers(FixedReference("right"), specs, outcomes, ("right", "wrong"), len(specs))
    assert [probe.ok for probe in probes] == [True, False]
    assert len(sampled) == sum(specs[i].n for i in greedy)
    assert [check.request.startswith(f"request {wrong} ") for check in sampled if not check.ok] == [True] * specs[
        wrong
    ].n
    _, three = check_answers(FixedReference("right"), specs, outcomes, ("right", "right"), 3)
    picked = sorted({int(check.request.split()[1]) for check in three})
    assert len(picked) == 3 and picked[0] == greedy[0] and picked[-1] >= greedy[len(greedy) // 2]


def test_parse_metrics_keys_labelled_samples_as_the_text_spells_them():
    text = '# TYPE pagedllm:requests_finished counter\npagedllm:requests_finished_total{finish_reason="abort"} 3.0\n'
    text += "# TYPE pagedllm:kv_blocks_used gauge\npagedllm:kv_blocks_used 0.0\n"
    metrics = parse_metrics(text)
    assert metrics['pagedllm:requests_finished_total{finish_reason="abort"}'] == 3.0
    assert metrics["pagedllm:kv_blocks_used"] == 0.0


@pytest.mark.slow  # a live server under a few hundred requests: scripts/test_slow.sh runs it
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
    # Greedy answers are the offline engine's: the probe before the mix and after it, and every greedy
    # request of the mix answered in full, of every kind, while the server was under load.
    assert all(probe.ok for probe in soak.probes) and soak.probes[0].expected, soak.probes
    assert [check for check in soak.sampled if not check.ok] == []
    checked = " ".join(check.request for check in soak.sampled)
    assert len(soak.sampled) >= 40, checked
    for kind in ("/v1/completions", "/v1/chat/completions", "streamed", "whole", "n=2"):
        assert kind in checked, kind
    assert 0 < soak.latency_p50_ms <= soak.latency_p99_ms
    assert soak.rss_growth_mib is not None and soak.rss_growth_mib < MAX_RSS_GROWTH_MB
    assert soak.ok, soak.failures
    assert "Traceback" not in server.log.read_text()


@pytest.mark.slow  # a live server under a few hundred requests: scripts/test_slow.sh runs it
def test_cli_soak_prints_the_summary_and_exits_0(server, capsys):
    argv = ["bench", "soak", "--base-url", server.url, "--requests", "10", "--concurrency", "4"]
    argv += ["--warmup-requests", "0", "--seed", "3", "--server-pid", str(server.process.pid)]
    assert main([*argv, "--reference-dtype", DTYPE]) == 0
    out = capsys.readouterr().out
    assert "Soak Result" in out and "Verdict:" in out and "PASS" in out
    assert "Sampled greedy answers = offline:" in out
    assert "Requests sent:" in out and "Server RSS before / after (MiB):" in out
