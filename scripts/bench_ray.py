"""Issue 30's figures: pagedllm's Ray Serve replicas on this machine.

1. The cost of Ray: output tok/s of `pagedllm bench serve`'s load against one replica through Ray and against
   plain `pagedllm serve`, the same model and threads, started fresh, left to settle and warmed alike, alternating
   `--rounds` times.
2. Prefix-aware against round-robin routing on two replicas, the library-assistant shape (8 system prompts, many
   users' questions, Poisson arrivals): prefix-cache hit rate (the replicas' token counters) and mean TTFT. The
   round-robin side goes through `/replicas/{i}/` in turn, with system prompts of its own, so neither side finds
   the other's blocks.

    python scripts/bench_ray.py [--model M] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.benchmarks.serve import SYNTHETIC_TEXT, BenchConfig, poisson_offsets, run_benchmark, send_request
from pagedllm.worker.launcher import free_port

SYSTEMS = 8
USERS_PER_SYSTEM = 8


def start(flags: list[str], log: Path, replicas: int) -> tuple[subprocess.Popen, str]:
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *flags]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            health = httpx.get(f"{url}/health", timeout=15)
            states = list(health.json().get("replicas", {"-": health.json().get("status")}).values())
            if health.status_code == 200 and states.count("ok") == replicas:
                return process, url
        except (httpx.TransportError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=90)
    finally:
        process.kill()


SETTLE_S = 20.0  # after start-up: Ray starts idle workers and agents for a while, which would count against it


def throughput(url: str, requests: int) -> float:
    time.sleep(SETTLE_S)
    config = BenchConfig(url, requests, float("inf"), None, 128, 64, True, 0, None, num_warmups=requests // 4)
    report = asyncio.run(run_benchmark(config))
    assert report["failed"] == 0, report["first_error"]
    return report["output_throughput"]


def cost_of_ray(model_flags: list[str], threads: str, rounds: int, requests: int, folder: Path) -> None:
    for round_index in range(rounds):
        figures = {}
        for name, extra in (("plain", []), ("ray", ["--distributed-executor-backend", "ray"])):
            process, url = start([*model_flags, "--threads-per-worker", threads, *extra], folder / f"{name}.log", 1)
            try:
                figures[name] = throughput(url, requests)
            finally:
                stop(process)
        ratio = figures["ray"] / figures["plain"]
        print(
            f"round {round_index + 1}: plain {figures['plain']:.1f} tok/s, one replica through Ray "
            f"{figures['ray']:.1f} tok/s: {ratio:.3f}x",
            flush=True,
        )


def library(seed: int) -> list[tuple[int, str]]:
    """(system index, prompt) of SYSTEMS long system prompts times USERS_PER_SYSTEM short questions, shuffled."""
    rng = random.Random(seed)
    words = SYNTHETIC_TEXT.split()
    systems = [f"Library {seed}-{s}: " + " ".join(rng.choices(words, k=150)) for s in range(SYSTEMS)]
    asks = [
        (s, f"{systems[s]}\nUser {u}: " + " ".join(rng.choices(words, k=12)))
        for s in range(SYSTEMS)
        for u in range(USERS_PER_SYSTEM)
    ]
    rng.shuffle(asks)
    return asks


def prefix_counters(url: str) -> tuple[float, float]:
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("pagedllm:prefix_cache_hits_total{"))
    queries = sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("pagedllm:prefix_cache_queries_total{")
    )
    return hits, queries


async def library_run(url: str, asks: list[tuple[int, str]], round_robin: bool, rate: float) -> list[float]:
    clients = [httpx.AsyncClient(base_url=f"{url}/replicas/{i}", timeout=300) for i in (0, 1)]
    routed = httpx.AsyncClient(base_url=url, timeout=300)
    offsets = poisson_offsets(len(asks), rate, random.Random(1))
    started = time.perf_counter()
    tasks = []
    for index, ((_, prompt), offset) in enumerate(zip(asks, offsets, strict=True)):
        await asyncio.sleep(max(started + offset - time.perf_counter(), 0.0))
        client = clients[index % 2] if round_robin else routed
        payload = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        tasks.append(asyncio.create_task(send_request(client, payload)))
    results = await asyncio.gather(*tasks)
    for client in [*clients, routed]:
        await client.aclose()
    failed = [r.error for r in results if not r.success]
    assert not failed, failed[0]
    return [r.ttft for r in results]


def routing(model_flags: list[str], threads: str, rounds: int, rate: float, folder: Path) -> None:
    flags = [
        *model_flags,
        "--threads-per-worker",
        threads,
        "--distributed-executor-backend",
        "ray",
        "--data-parallel-size",
        "2",
    ]
    for round_index in range(rounds):
        process, url = start([*flags, "--served-model-name", "m"], folder / "routing.log", 2)
        try:
            warm = library(seed=1000 + round_index)[:8]
            asyncio.run(library_run(url, warm, round_robin=True, rate=rate))
            for round_robin, seed in ((False, 2 * round_index), (True, 2 * round_index + 1)):
                before = prefix_counters(url)
                ttfts = asyncio.run(library_run(url, library(seed), round_robin, rate))
                after = prefix_counters(url)
                hit = (after[0] - before[0]) / max(after[1] - before[1], 1.0)
                name = "round-robin" if round_robin else "prefix-aware"
                mean, median = statistics.mean(ttfts) * 1000, statistics.median(ttfts) * 1000
                print(
                    f"round {round_index + 1} {name}: prefix hit rate {hit:.3f}, "
                    f"mean TTFT {mean:.0f} ms, p50 {median:.0f} ms",
                    flush=True,
                )
        finally:
            stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="requests of the throughput load")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s of the library load")
    parser.add_argument("--only", choices=("cost", "routing"), default=None)
    args = parser.parse_args()
    model_flags = ["--model", args.model] if args.model else []
    cores = str(max(1, len(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory() as folder:
        if args.only in (None, "cost"):
            cost_of_ray(model_flags, cores, args.rounds, args.requests, Path(folder))
        if args.only in (None, "routing"):
            half = str(max(1, int(cores) // 2))
            routing(model_flags, half, args.rounds, args.rate, Path(folder))


if __name__ == "__main__":
    main()
