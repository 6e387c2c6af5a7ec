"""`pagedllm serve --distributed-executor-backend ray --data-parallel-size 2`: two engine replicas on a local Ray
cluster behind one endpoint. Greedy answers equal the offline engine's, prefixes stick to one replica, a
replica whose engine is killed fails its requests fast and is replaced, and nothing of Ray outlives the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig, ServeOptions
from pagedllm.entrypoints.openai.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.metrics import RequestTiming, ServerMetrics
from pagedllm.entrypoints.ray_serve import check_replica_options, scaling
from pagedllm.entrypoints.ray_serve.front import gather_metrics, router_metrics
from pagedllm.entrypoints.ray_serve.router import PREFIX_BLOCKS, PrefixIndex, RoutingCounts, prompt_prefix
from tests.test_server import ServerProcess, free_port, sse_data

MODEL_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "16", "--served-model-name", "m"]
PROMPTS = ["The quick brown fox", "Paged attention stores the key", "Hello world! Numbers like"]
SYSTEMS = [
    "Paged attention stores the key value cache in fixed size blocks. A block table maps logical blocks. ",
    "Continuous batching admits new requests at every iteration. Copy on write keeps shared blocks safe. ",
    "Hello world! Numbers like 12345 and symbols also appear. The quick brown fox jumps over the lazy dog. ",
    "A block table maps logical blocks to physical blocks in the pool. Continuous batching admits requests. ",
]
QUESTIONS = [f"Question {i}: the quick brown fox" for i in range(10)]


def ray_processes() -> list[str]:
    """Ray's own processes on this machine (the GCS, raylets, workers, the dashboard agents)."""
    found = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    markers = ("gcs_server", "raylet", "ray::", "default_worker.py", "dashboard/agent.py", "runtime_env/agent")
    return [line for line in found if any(marker in line for marker in markers)]


def start_ray_server(model: Path, log: Path, *flags: str, replicas: int = 2) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "pagedllm", "serve", "--model", str(model), "--port", str(port), *MODEL_FLAGS]
    command += ["--distributed-executor-backend", "ray", *flags]
    with log.open("w") as sink:  # a file, not a pipe: a pipe nobody reads would block the server's logging
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_replicas(server, replicas, timeout=180)
    except AssertionError:
        stop_ray_server(server)
        raise
    return server


def stop_ray_server(server: ServerProcess, sig: signal.Signals = signal.SIGINT) -> int:
    server.process.send_signal(sig)
    try:
        return server.process.wait(timeout=60)
    finally:
        server.process.kill()


def wait_replicas(server: ServerProcess, count: int, timeout: float) -> float:
    """Seconds until /health lists `count` replicas whose engines run."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        assert server.process.poll() is None, f"server exited:\n{server.log.read_text()}"
        try:
            health = httpx.get(f"{server.url}/health", timeout=15).json()
            if list(health.get("replicas", {}).values()).count("ok") == count:
                return time.monotonic() - started
        except (httpx.TransportError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{count} replicas not healthy after {timeout} s:\n{server.log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def ray_server(tiny_llama, tmp_path_factory) -> Iterator[ServerProcess]:
    assert not ray_processes(), "a Ray cluster is already running here"
    server = start_ray_server(tiny_llama, tmp_path_factory.mktemp("ray") / "server.log", "--data-parallel-size", "2")
    yield server
    assert stop_ray_server(server, signal.SIGINT) == 0, server.log.read_text()[-4000:]  # Ctrl-C
    assert not ray_processes(), "Ray processes outlived the server"


def complete(server: ServerProcess, prompt: str, max_tokens: int = 8, path: str = "/v1/completions") -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_greedy_equals_offline_engine_and_streamed_equals_whole(ray_server: ServerProcess, tiny_llama):
    served = [complete(ray_server, prompt) for prompt in PROMPTS]
    assert all(answer.status_code == 200 for answer in served), [answer.text for answer in served]
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256)
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert [answer.json()["choices"][0]["text"] for answer in served] == [o.outputs[0].text for o in offline]
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{ray_server.url}/v1/completions", json=body, timeout=60) as response:
        pieces = [json.loads(data)["choices"][0]["text"] for data in sse_data(response) if data != "[DONE]"]
    assert "".join(pieces) == offline[0].outputs[0].text
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4}
    assert httpx.post(f"{ray_server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    bad = httpx.post(f"{ray_server.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def hits_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prompt tokens each replica found in its prefix cache between two scrapes."""
    prefix = "pagedllm:prefix_cache_hits_total{"
    counted = {name: value for name, value in after.items() if name.startswith(prefix)}
    return {name.split('"')[1]: value - before.get(name, 0.0) for name, value in counted.items()}


def shared_block_tokens(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> int:
    """Tokens in the full blocks (the server's default size) every one of `prompts` shares: what the prefix cache
    gives each after the first."""
    block_size = EngineConfig().block_size
    ids = [tokenizer.encode(prompt) for prompt in prompts]
    columns = enumerate(zip(*ids, strict=False))  # stops at the shortest prompt
    common = next((at for at, column in columns if len(set(column)) > 1), min(map(len, ids)))
    return common // block_size * block_size


def test_prefix_routing_keeps_each_prefix_on_one_replica(ray_server: ServerProcess, tiny_llama):
    """Every request after a prefix's first finds that prefix's full blocks cached on its replica: the hits each
    replica counts are exactly those of the prefixes routed to it (whatever earlier tests sent, wherever the load
    put each prefix)."""
    before = ray_server.metrics()
    replicas: dict[int, set[str]] = {index: set() for index in range(len(SYSTEMS))}
    for question in QUESTIONS:  # a round: every prefix at once
        threads = []

        def ask(index: int, prompt: str) -> None:
            answer = complete(ray_server, prompt, max_tokens=2)
            assert answer.status_code == 200, answer.text
            replicas[index].add(answer.headers["x-pagedllm-replica"])

        for index, system in enumerate(SYSTEMS):
            threads.append(threading.Thread(target=ask, args=(index, system + question)))
            threads[-1].start()
        for thread in threads:
            thread.join()
    assert all(len(used) == 1 for used in replicas.values()), replicas
    assert len(set().union(*replicas.values())) == 2, "the four prefixes all went to one replica"
    expected = dict.fromkeys(set().union(*replicas.values()), 0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    for index, system in enumerate(SYSTEMS):
        shared = shared_block_tokens(tokenizer, [system + question for question in QUESTIONS])
        assert shared > 0, system
        expected[next(iter(replicas[index]))] += (len(QUESTIONS) - 1) * shared
    assert hits_since(before, ray_server.metrics()) == expected


def test_round_robin_baseline_hits_less(ray_server: ServerProcess, tmp_path):
    """The same shape sent round-robin through the per-replica paths, new prefixes so nothing is cached yet."""
    before = {name: value for name, value in ray_server.metrics().items() if "prefix_cache_hit" in name}
    hits = {}
    for round_robin in (False, True):
        salt = "round robin " if round_robin else "routed "
        for count, question in enumerate(QUESTIONS[:6]):
            for index, system in enumerate(SYSTEMS[:2]):
                path = f"/replicas/{(count + index) % 2}/v1/completions" if round_robin else "/v1/completions"
                prompt = salt + system + question
                answer = complete(ray_server, prompt, max_tokens=1, path=path)
                assert answer.status_code == 200, answer.text
        hits[round_robin] = prompt_hit_tokens(ray_server)
    routed, round_robin = hits[False] - prompt_hit_tokens_of(before), hits[True] - hits[False]
    assert round_robin < routed, (routed, round_robin)


def prompt_hit_tokens(server: ServerProcess) -> float:
    return prompt_hit_tokens_of(server.metrics())


def prompt_hit_tokens_of(metrics: dict[str, float]) -> float:
    return sum(value for name, value in metrics.items() if name.startswith("pagedllm:prefix_cache_hits_total"))


def test_a_stored_conversation_is_continued_on_the_replica_that_holds_it(ray_server: ServerProcess):
    """Each replica keeps its own responses: the front sends every turn of a chain, and every read of a stored
    response, to the replica that stored it (with two replicas, a random pick would miss half the time)."""
    url = f"{ray_server.url}/v1/responses"
    previous, ids = None, []
    for turn in range(8):
        body = {"model": "m", "input": f"turn {turn}", "max_output_tokens": 2, "previous_response_id": previous}
        streamed = turn % 2 == 1
        response = httpx.post(url, json=body | {"stream": streamed}, timeout=60)
        assert response.status_code == 200, response.text
        if streamed:
            created = next(line for line in response.text.splitlines() if line.startswith("data: "))
            previous = json.loads(created.removeprefix("data: "))["response"]["id"]
        else:
            previous = response.json()["id"]
        ids.append(previous)
    for response_id in ids:
        assert httpx.get(f"{url}/{response_id}", timeout=60).json()["id"] == response_id


def test_per_replica_paths_and_aggregated_metrics(ray_server: ServerProcess):
    for index in (0, 1):
        health = httpx.get(f"{ray_server.url}/replicas/{index}/health", timeout=15)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert "<html" in httpx.get(f"{ray_server.url}/replicas/{index}/kv", timeout=15).text.lower()
    missing = httpx.get(f"{ray_server.url}/replicas/7/health", timeout=15)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "replica"
    metrics = ray_server.metrics()
    assert len({name for name in metrics if name.startswith("pagedllm:num_requests_running{")}) == 2
    assert metrics['pagedllm:router_decisions_total{by="prefix"}'] > 0


def core_pids(server: ServerProcess) -> list[int]:
    """The engine cores: spawned by the replicas, each a `multiprocessing.spawn` child of a Ray worker."""
    lines = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()
    parents = {int(line.split()[0]) for line in lines if "ServeReplica:pagedllm:PagedLLMEngine" in line}
    return [int(line.split()[0]) for line in lines if "spawn_main" in line and int(line.split()[1]) in parents]


@pytest.mark.slow  # waits for Ray to replace the replica (about 20 s): in scripts/test_slow.sh
def test_killed_engine_fails_fast_and_is_replaced(ray_server: ServerProcess):
    """One replica's engine core is killed once every stream has started. The streams go to each replica by its own
    path, two each, so the killed one holds streams whichever it is (the router's load spread can put them all on
    one replica under a busy machine); the whole answers go through the router, which retries them elsewhere."""
    cores = core_pids(ray_server)
    assert len(cores) == 2, cores
    results: dict[int, tuple[bool, float, int, str]] = {}
    streaming = threading.Barrier(5)  # the four streams and this thread

    def long_request(index: int, stream: bool) -> None:
        body = {"model": "m", "prompt": PROMPTS[index % 3], "max_tokens": 400, "temperature": 0.0, "stream": stream}
        path = f"/replicas/{index // 2 % 2}/v1/completions" if stream else "/v1/completions"
        with httpx.stream("POST", f"{ray_server.url}{path}", json=body, timeout=60) as response:
            chunks = response.iter_text()
            text = next(chunks)
            if stream:
                streaming.wait()
            text += "".join(chunks)
        status = 503 if stream and '"error"' in text else response.status_code
        results[index] = (stream, time.monotonic(), status, text[-300:])

    threads = [threading.Thread(target=long_request, args=(i, i % 2 == 0)) for i in range(8)]
    for thread in threads:
        thread.start()
    streaming.wait(timeout=30)
    os.kill(cores[0], signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 8
    failed = [result for result in results.values() if result[2] != 200]
    assert all(stream and status == 503 for stream, _, status, _ in failed), results
    assert len(failed) == 2, results  # the killed replica's two streams
    assert all(done - killed < 5 for _, done, _, _ in failed), results
    assert all(complete(ray_server, prompt).status_code == 200 for prompt in PROMPTS * 2)
    assert wait_replicas(ray_server, 2, timeout=30) < 30
    assert all(
        complete(ray_server, PROMPTS[0], path=f"/replicas/{i}/v1/completions").status_code == 200 for i in (0, 1)
    )


# ---- without a cluster ---------------------------------------------------------------------------


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_the_fronts_hashes_are_the_blocks_the_engine_reports(tiny_llama, salt):
    """Routing rests on this: the front's hashes of a prompt's first blocks are the hashes the replica's engine
    stores them under (its KV events), with the cache salt; a block past the routed prefix is not indexed."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64)
    index = PrefixIndex()
    llm.engine.add_kv_event_sink(index.apply)
    prompt = " ".join(SYSTEMS * 2)
    token_ids = llm.engine.tokenizer.encode(prompt)
    assert len(token_ids) >= (PREFIX_BLOCKS + 1) * 16
    llm.generate([{"prompt": prompt, "cache_salt": salt}], SamplingParams(max_tokens=1))
    routed = prompt_prefix(token_ids, 16, salt)
    assert len(routed) == PREFIX_BLOCKS
    assert sorted(index.hashes()) == sorted(routed)
    assert prompt_prefix(token_ids, 16, "another salt")[0] not in index.hashes()


def test_replica_options():
    fixed = ServeOptions(data_parallel_size=3)
    assert scaling(fixed) == {"num_replicas": 3}
    auto = scaling(ServeOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=8.0, data_parallel_size=2))
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 2,
        "target_ongoing_requests": 8.0,
    }
    with pytest.raises(ValueError, match="needs both"):
        check_replica_options(EngineConfig(model=None), ServeOptions(min_replicas=2))
    with pytest.raises(ValueError, match="above --max-replicas"):
        check_replica_options(EngineConfig(model=None), ServeOptions(min_replicas=3, max_replicas=2))


@pytest.mark.parametrize("flag", ["--data-parallel-size", "--min-replicas", "--max-replicas"])
def test_replicas_need_the_ray_backend(tiny_llama, flag):
    command = [sys.executable, "-m", "pagedllm", "serve", "--model", str(tiny_llama), flag, "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--distributed-executor-backend ray" in done.stderr


def test_a_stopped_engine_core_fails_the_health_check_a_replica_answers_serve(tiny_llama):
    """A replica's health check asks its core to answer (`responsive`): a core that is alive but stopped does not."""

    async def check() -> None:
        options = {"model": str(tiny_llama), "dtype": "float32", "num_kv_blocks": 64}
        engine = AsyncLLMEngine(options, ServerMetrics(), max_waiting=16, start_method="spawn")
        engine.start()
        try:
            assert await engine.responsive(10.0)
            os.kill(engine.core_pid, signal.SIGSTOP)
            assert engine.is_running and not await engine.responsive(1.0)
            os.kill(engine.core_pid, signal.SIGCONT)
            assert await engine.responsive(10.0)
        finally:
            await engine.shutdown()

    asyncio.run(check())


def test_gathered_metrics_label_every_replicas_samples_and_keep_each_family_once():
    texts = {}
    for replica, tokens in (("a", 3), ("b", 5)):
        metrics = ServerMetrics()
        metrics.observe_generated(tokens)
        metrics.observe_end("stop", RequestTiming(arrival=0.0, first_token=1.0, end=2.0, num_output_tokens=tokens))
        texts[replica] = metrics.render().decode()
    counts = RoutingCounts()
    counts.record("prefix", "a")
    gathered = gather_metrics(texts, router_metrics(counts)).decode()
    families = {family.name: family for family in text_string_to_metric_families(gathered)}
    tokens = {
        s.labels["replica"]: s.value
        for s in families["pagedllm:generation_tokens"].samples
        if s.name.endswith("_total")
    }
    assert tokens == {"a": 3.0, "b": 5.0}
    buckets = [s for s in families["pagedllm:e2e_request_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["replica"] for s in buckets} == {"a", "b"} and all("le" in s.labels for s in buckets)
    assert gathered.count("# HELP pagedllm:generation_tokens_total") == 1
    decisions = {
        s.labels["by"]: s.value for s in families["pagedllm:router_decisions"].samples if s.name.endswith("_total")
    }
    assert decisions == {"prefix": 1.0, "load": 0.0, "replica": 0.0}
