"""`pagedllm bench memory`: how much of the KV memory holds token state, paged vs contiguous.

A workload's trace (prompt and output length per request, all arriving at once) is replayed step
by step under one memory budget, with iteration-level batching for every allocator: a request is
admitted (FIFO) when its reservation fits, its prompt and first token come in the admission step,
one token per step after that, and it leaves after its last token. Allocators:

- paged: pagedllm's own block manager (`KVCacheManager`), blocks of `block_size` taken as the
  sequence grows; when a step cannot grow, the newest request is preempted and requeued;
- orca-max: a contiguous reservation of `max_model_len` per request;
- orca-pow2: the next power of two of the request's final length;
- orca-oracle: exactly its final length.

η at a step is tokens stored / slots reserved; the report gives its mean over steps (the vLLM
paper's Figure 2) and the peak number of requests held at once.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from dataclasses import asdict, dataclass, field

from pagedllm.kv.kv_cache_manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt_len: int
    output_len: int

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(slots=True)
class MemoryResult:
    allocator: str
    mean_utilization: float
    peak_concurrency: int
    steps: int
    utilization: list[float] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)


def contiguous_reservation(policy: str, request: TraceRequest, max_model_len: int) -> int:
    if policy == "orca-max":
        return max_model_len
    if policy == "orca-pow2":
        return 1 << (request.final_len - 1).bit_length()
    if policy == "orca-oracle":
        return request.final_len
    raise ValueError(f"unknown allocator {policy!r}")


def replay_contiguous(trace: list[TraceRequest], budget: int, policy: str, max_model_len: int) -> MemoryResult:
    waiting = deque(range(len(trace)))
    lengths: dict[int, int] = {}
    reserved: dict[int, int] = {}
    result = MemoryResult(policy, 0.0, 0, 0)
    while waiting or lengths:
        for index in list(lengths):
            lengths[index] += 1
        while (
            waiting
            and sum(reserved.values()) + contiguous_reservation(policy, trace[waiting[0]], max_model_len) <= budget
        ):
            index = waiting.popleft()
            reserved[index] = contiguous_reservation(policy, trace[index], max_model_len)
            lengths[index] = trace[index].prompt_len + 1
        if not lengths:
            raise ValueError(f"a request does not fit a budget of {budget} slots under {policy}")
        _record(result, sum(lengths.values()), sum(reserved.values()), len(lengths))
        for index in [i for i, n in lengths.items() if n >= trace[i].final_len]:
            del lengths[index], reserved[index]
    return _finish(result)


def replay_paged(trace: list[TraceRequest], budget: int, block_size: int) -> MemoryResult:
    kv = KVCacheManager(budget // block_size, block_size, enable_prefix_caching=False)
    waiting = deque(range(len(trace)))
    lengths: dict[int, int] = {}
    result = MemoryResult(f"paged-{block_size}", 0.0, 0, 0)
    while waiting or lengths:
        for index in list(lengths):
            while index in lengths and not kv.allocate_slots(index, lengths[index], 1, []):
                newest = max(lengths)  # preempt by recompute: the newest request gives its blocks back
                kv.free(newest)
                del lengths[newest]
                waiting.appendleft(newest)
            if index in lengths:
                lengths[index] += 1
        while waiting and kv.allocate_slots(waiting[0], 0, trace[waiting[0]].prompt_len + 1, []):
            index = waiting.popleft()
            lengths[index] = trace[index].prompt_len + 1
        if not lengths:
            raise ValueError(f"a request does not fit a budget of {budget} slots in blocks of {block_size}")
        _record(result, sum(lengths.values()), kv.pool.num_used * block_size, len(lengths))
        for index in [i for i, n in lengths.items() if n >= trace[i].final_len]:
            kv.free(index)
            del lengths[index]
    return _finish(result)


def _record(result: MemoryResult, stored: int, reserved: int, concurrency: int) -> None:
    result.utilization.append(stored / reserved)
    result.concurrency.append(concurrency)


def _finish(result: MemoryResult) -> MemoryResult:
    result.steps = len(result.utilization)
    result.mean_utilization = sum(result.utilization) / result.steps
    result.peak_concurrency = max(result.concurrency)
    return result


def synthetic_trace(num_requests: int, max_model_len: int, seed: int) -> list[TraceRequest]:
    """The throughput benchmark's workload: prompts U[32, 512], outputs U[16, 256]."""
    rng = random.Random(seed)
    trace = [TraceRequest(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(num_requests)]
    return [t for t in trace if t.final_len <= max_model_len]


def run_all(trace: list[TraceRequest], budget: int, max_model_len: int, block_sizes: list[int]) -> list[MemoryResult]:
    results = [replay_contiguous(trace, budget, p, max_model_len) for p in ("orca-max", "orca-pow2", "orca-oracle")]
    return results + [replay_paged(trace, budget, size) for size in block_sizes]


def add_bench_memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--budget", type=int, default=32768, help="KV memory in token slots")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-sizes", default="1,8,16,32,64,128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every series here")


def run_bench_memory(args: argparse.Namespace) -> int:
    trace = synthetic_trace(args.num_prompts, args.max_model_len, args.seed)
    sizes = [int(size) for size in args.block_sizes.split(",")]
    results = run_all(trace, args.budget, args.max_model_len, sizes)
    print(f"{len(trace)} requests, budget {args.budget} token slots, max_model_len {args.max_model_len}")
    print(f"{'allocator':<12} {'mean η':>7} {'peak concurrency':>17} {'steps':>6}")
    for r in results:
        print(f"{r.allocator:<12} {r.mean_utilization:>7.1%} {r.peak_concurrency:>17} {r.steps:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f)
    return 0
