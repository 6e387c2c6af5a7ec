"""Tensor parallelism on torch.distributed (gloo, real worker processes on this machine): greedy tokens
equal the single-process engine's, through chunked prefill, prefix-cache hits, forks, beam search and
preemption; bad sizes and ports are refused before any process starts; a dead rank fails the engine within
its timeout; no process outlives the engine."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from tests.conftest import save_tiny_model
from tests.test_families import FAMILIES, prompts_for
from tests.test_server import start_server

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "A block table maps",
    "Hello world! Numbers like 12345",
    "The quick brown fox jumps over the lazy dog. Continuous batching admits new requests",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def children() -> set[int]:
    """This process's live children (Linux: /proc lists each thread's); zombies do not count."""
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            status = Path(f"/proc/{pid}/status")
            if status.exists() and "State:\tZ" not in status.read_text():
                pids.add(int(pid))
    return pids


def run_all(llm: LLM) -> dict[str, list]:
    """Greedy, seeded n=4 samples and beams, each twice (the second time from the prefix cache)."""
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    results = {}
    for round_ in (0, 1):
        results[f"greedy{round_}"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        results[f"n4_{round_}"] = [
            [c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], sampled, use_tqdm=False)
        ]
        results[f"beam{round_}"] = [[c.token_ids for c in o.outputs] for o in llm.beam_search(PROMPTS[:2], beams)]
    return results


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """8 query heads over 2 KV heads, q/k/v biases (Qwen2), untied embeddings."""
    return save_tiny_model(tmp_path_factory.mktemp("tp_qwen2"), "qwen2", num_attention_heads=8, num_key_value_heads=2)


# Four ranks on two cores run long: in the slow suite (two ranks cover the same code here).
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_equals_one_process(gqa_model, world_size):
    options = dict(model=gqa_model, dtype="float32", block_size=4, max_num_batched_tokens=16)
    expected = run_all(LLM(**options))
    before = children()
    llm = LLM(**options, tensor_parallel_size=world_size)  # 4 ranks > 2 KV heads: KV heads replicated
    assert len(children() - before) == world_size - 1
    assert run_all(llm) == expected
    assert llm.stats().prefix_cache_hits > 0
    llm.engine.shutdown()
    assert children() <= before


def qwen2_shard_bytes(folder: Path, world_size: int) -> int:
    """The float32 bytes one rank of `world_size` keeps of a Qwen2 model (q/k/v biases, no o bias),
    counted from its config.json alone: query heads, MLP channels and vocabulary rows (zero-padded) split
    over the ranks, KV heads split or (fewer than ranks) one each, norms whole."""
    config = json.loads((folder / "config.json").read_text())
    hidden, head_dim, layers = config["hidden_size"], config["head_dim"], config["num_hidden_layers"]
    q = config["num_attention_heads"] // world_size * head_dim
    kv = max(1, config["num_key_value_heads"] // world_size) * head_dim
    mlp = config["intermediate_size"] // world_size
    layer = (q + 2 * kv) * (hidden + 1) + q * hidden + 3 * mlp * hidden + 2 * hidden
    vocab = math.ceil(config["vocab_size"] / world_size) * hidden
    return 4 * (layers * layer + 2 * vocab + hidden)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_each_rank_holds_its_shard_and_the_ranks_sum_their_parts(gqa_model, world_size):
    """The token tests above would pass with every rank running the whole model: each rank's own process
    says what it holds and that it took part in the sums."""
    llm = LLM(model=gqa_model, dtype="float32", block_size=4, tensor_parallel_size=world_size)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    reports = llm.engine.worker.shard_reports()
    llm.engine.shutdown()
    (whole,) = LLM(model=gqa_model, dtype="float32").engine.worker.shard_reports()
    assert whole.parameter_bytes == qwen2_shard_bytes(gqa_model, 1)
    assert whole.collectives.all_reduce == 0
    assert len(reports) == world_size
    for report in reports:
        assert report.parameter_bytes == qwen2_shard_bytes(gqa_model, world_size)
        assert report.kv_heads == 1  # 2 KV heads: split over 2 ranks, one each of 4
    # Per forward pass: the embedding's sum, then o_proj's and down_proj's in each layer; every rank the same.
    layers = json.loads((gqa_model / "config.json").read_text())["num_hidden_layers"]
    counts = reports[0].collectives
    assert counts.all_reduce > 0 and counts.all_reduce % (2 * layers + 1) == 0 and counts.all_gather > 0
    assert all(report.collectives == counts for report in reports)


def test_tied_embeddings_and_eight_queries_per_kv_head(tiny_llama_tied_gqa8):
    options = dict(model=tiny_llama_tied_gqa8, dtype="float32", block_size=4)
    expected = LLM(**options).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(**options, tensor_parallel_size=2)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    llm.engine.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tensor_parallelism(tiny_llama, mode):
    options = dict(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=40, preemption_mode=mode)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    expected = LLM(**options, swap_space=0.01).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(**options, swap_space=0.01, tensor_parallel_size=2)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions > 0) == (mode == "swap")
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    llm.engine.shutdown()


def test_the_default_model_on_three_ranks_equals_one():
    # SmolLM2-135M: 9 query heads and 3 KV heads, both divided by 3.
    prompts = ["What is the capital of France?", "Write a haiku about memory pages."]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = LLM(dtype="float32", num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    llm = LLM(dtype="float32", num_kv_blocks=256, tensor_parallel_size=3)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    llm.engine.shutdown()


@pytest.mark.parametrize(
    ("world_size", "message"),
    [(3, "does not divide the 4 attention heads"), (8, "does not divide the 4 attention heads")],
)
def test_sizes_the_model_cannot_split_are_refused_before_any_process_starts(tiny_llama, world_size, message):
    before = children()
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=world_size)
    assert children() == before


def test_a_port_in_use_is_refused(tiny_llama):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"master port 127.0.0.1:{port} is not free"):
            LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=2, master_port=port)


def test_a_dead_rank_fails_the_engine_within_its_timeout_and_leaves_no_orphan(tiny_llama):
    before = children()
    llm = LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=2, distributed_timeout=10.0)
    (follower,) = children() - before
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    os.kill(follower, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 15.0
    llm.engine.shutdown()
    assert children() <= before


def test_deleting_the_engine_stops_its_ranks(tiny_llama):
    before = children()
    llm = LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=2)
    assert children() - before
    del llm
    deadline = time.monotonic() + 15
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children() - before


def test_two_nodes_on_one_machine(tiny_llama, tmp_path):
    """Node 1 is `pagedllm worker` in a process of its own, node 0 the engine here: they meet over TCP."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = ["--model", str(tiny_llama), "--dtype", "float32", "--tensor-parallel-size", "4", "--nnodes", "2"]
    common += ["--master-port", str(port), "--distributed-timeout", "60"]
    log = tmp_path / "node1.log"
    with log.open("w") as sink:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "pagedllm", "worker", *common, "--node-rank", "1"], stdout=sink, stderr=sink
        )
    try:
        llm = LLM(model=tiny_llama, dtype="float32", tensor_parallel_size=4, nnodes=2, master_port=port)
        expected = LLM(model=tiny_llama, dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False)
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        llm.engine.shutdown()
        assert node1.wait(timeout=30) == 0, log.read_text()
    finally:
        node1.kill()


def test_a_node_that_never_comes_fails_start_up_within_the_timeout(tiny_llama):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    before = children()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 0 of 4 could not join .* tcp://127.0.0.1:{port}"):
        LLM(
            model=tiny_llama, dtype="float32", tensor_parallel_size=4, nnodes=2, master_port=port, distributed_timeout=5
        )
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 15
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children() - before


# Each option the sharding must respect, once (all nine families passed when this was written; five keep
# the CI run short): biases (Llama), q/k norms (Qwen3), Gemma's sandwich norms and soft-caps, Phi3's fused
# checkpoint and partial rotary, sliding windows and split experts beside a dense layer (Qwen3-MoE).
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "qwen3_moe"])
def test_families_on_two_ranks_equal_one(family, tmp_path):
    model_type, options, _ = FAMILIES[family]
    folder = save_tiny_model(tmp_path, model_type, seed=len(family), **options)
    prompts = prompts_for(380, seed=len(family))
    expected = LLM(model=folder, dtype="float32", block_size=4).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    llm = LLM(model=folder, dtype="float32", block_size=4, tensor_parallel_size=2)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_a_server_whose_rank_dies_fails_its_requests_and_exits_non_zero(tiny_llama, tmp_path):
    server = start_server(
        tiny_llama, tmp_path / "server.log", "--tensor-parallel-size", "2", "--distributed-timeout", "10"
    )
    try:
        # The server's engine core (a child) leads the group; the other rank is the core's child.
        (follower,) = [pid for pid in descendants(server.process.pid) if b"worker.follower" in cmdline(pid)]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=str(tiny_llama), prompt="Hello", max_tokens=4).choices[0].text
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(openai.InternalServerError, match="tensor-parallel"):
            client.completions.create(model=str(tiny_llama), prompt="Hello again", max_tokens=8)
        assert server.process.wait(timeout=30) == 1, (tmp_path / "server.log").read_text()
    finally:
        server.process.kill()


def descendants(pid: int) -> set[int]:
    children = children_of(pid)
    return children.union(*(descendants(child) for child in children))


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def children_of(pid: int) -> set[int]:
    return {
        int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()
    }
