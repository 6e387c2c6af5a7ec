"""Tensor parallelism on Ray (`distributed_executor_backend="ray"`): rank 0 in the engine's process, rank 1 a Ray
actor. Served, in a replica whose killed rank gets it replaced; offline, on another logical node of a local cluster
(the head offers no CPU, so the rank's bundle cannot land there)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from pagedllm import LLM, SamplingParams
from pagedllm.engine import EngineDeadError
from tests.test_ray_serve import complete, ray_processes, start_ray_server, stop_ray_server, wait_replicas

PROMPTS = ["The quick brown fox", "Paged attention stores the key value cache", "Hello world! Numbers like"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.mark.slow  # a second Ray server, most of a minute: scripts/test_slow.sh runs it
def test_a_served_replica_of_two_ranks_is_replaced_when_a_rank_dies(tiny_llama, tmp_path):
    """First in this module: its server starts a Ray of its own, and no other may run meanwhile."""
    assert not ray_processes(), "a Ray cluster is already running here"
    flags = ("--tensor-parallel-size", "2", "--threads-per-worker", "1")
    server = start_ray_server(tiny_llama, tmp_path / "server.log", *flags, replicas=1)
    try:
        expected = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256).generate(PROMPTS, GREEDY, use_tqdm=False)
        served = [complete(server, prompt, max_tokens=12).json()["choices"][0]["text"] for prompt in PROMPTS]
        assert served == [o.outputs[0].text for o in expected]
        (pid,) = rank_pids()
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        answer = complete(server, PROMPTS[0])
        assert answer.status_code == 503 and time.monotonic() - started < 5, answer.text
        assert wait_replicas(server, 1, timeout=30) < 30
        assert complete(server, PROMPTS[0]).status_code == 200
    finally:
        code = stop_ray_server(server, signal.SIGTERM)
    assert code == 0, server.log.read_text()[-4000:]
    assert not ray_processes(), "Ray processes outlived the server"


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    cluster.worker_node_id = worker.node_id
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def rank_nodes() -> list[str]:
    """The nodes of the ranks' placement-group bundles, of the groups that are placed."""
    groups = ray.util.placement_group_table().values()
    return [node for group in groups if group["state"] == "CREATED" for node in group["bundles_to_node_id"].values()]


def rank_pids() -> list[int]:
    found = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [int(line.split()[0]) for line in found if "ray::RankActor" in line]


def test_two_ranks_on_ray_equal_one_process(two_nodes, tiny_llama):
    options = dict(model=tiny_llama, dtype="float32", block_size=4, threads_per_worker=1)
    expected = LLM(**options).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(**options, tensor_parallel_size=2, distributed_executor_backend="ray")
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert rank_nodes() == [two_nodes.worker_node_id]
    assert len(rank_pids()) == 1
    llm.engine.shutdown()
    assert not rank_nodes(), "the ranks' placement group outlived the engine"
    deadline = time.monotonic() + 10
    while rank_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_pids(), "the rank's actor outlived the engine"


def test_a_killed_rank_fails_the_engine(two_nodes, tiny_llama):
    llm = LLM(
        model=tiny_llama,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        threads_per_worker=1,
        distributed_timeout=10.0,
    )
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    (pid,) = rank_pids()
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - started < 15
    llm.engine.shutdown()
