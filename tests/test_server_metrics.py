"""Every series of `/metrics` against what the clients saw, on a tiny server whose pool is too small for its
load, so that preemption (by swapping) and the prefix cache both show."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from tests.test_server import ServerProcess, start_server, stop_server

NUM_REQUESTS = 6
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def crowded(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("metrics_server") / "server.log"
    # 20 blocks of 16 tokens: six requests of 40 + 60 tokens need 42 at their ends.
    server = start_server(tiny_llama, log, "--num-kv-blocks", "20", "--preemption-mode", "swap")
    yield server
    assert stop_server(server) == 0, log.read_text()


def complete(server: ServerProcess, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_counters_and_histograms_agree_with_the_clients_and_show_preemption(crowded):
    before = crowded.metrics()
    prompts = [[7 + i] * 40 for i in range(NUM_REQUESTS)]
    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        usages = list(pool.map(lambda p: complete(crowded, p), prompts))
    crowded.wait_for("pagedllm:num_requests_running", lambda v: v == 0)
    crowded.wait_for("pagedllm:kv_blocks_used", lambda v: v == 0)
    after = crowded.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("pagedllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) == 40 * NUM_REQUESTS
    assert grew("pagedllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert grew('pagedllm:requests_finished_total{finish_reason="length"}') == NUM_REQUESTS
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"pagedllm:{histogram}_count") == NUM_REQUESTS, histogram
        assert grew(f"pagedllm:{histogram}_sum") > 0
    assert grew("pagedllm:num_preemptions_total") >= 1  # the pool could not hold every request's end
    assert after["pagedllm:kv_blocks_peak"] == after["pagedllm:kv_blocks_total"] == 20
    assert after["pagedllm:swapped_blocks"] == 0  # everything swapped out came back


def test_a_repeated_prompt_raises_the_prefix_cache_hit_rate(crowded):
    prompt = list(range(100, 164))  # four full blocks
    complete(crowded, prompt)
    first = crowded.metric("pagedllm:prefix_cache_hit_rate")
    complete(crowded, prompt)
    crowded.wait_for("pagedllm:prefix_cache_hit_rate", lambda rate: rate > first)
