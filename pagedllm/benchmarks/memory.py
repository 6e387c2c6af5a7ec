"""`pagedllm bench memory`: how much of the KV memory holds token state, paged vs contiguous.

A workload's trace (prompt tokens, output length and samples per request, all arriving at once) is
replayed step by step under one memory budget, with iteration-level batching for every allocator:
a request is admitted (FIFO) when its reservation fits, its prompt and first token come in the
admission step, one token per step after that, and it leaves after its last token. Allocators:

- paged: pagedllm's own block manager (`KVCacheManager`, prefix caching on as the engine runs it),
  blocks of `block_size` taken as the sequence grows; a request's prompt is allocated once and its
  other samples are forked from it, so they share the prompt's blocks and copy the partly filled
  last one on their first write; when a step cannot grow, the newest request is preempted and
  requeued;
- orca-max: a contiguous reservation of `max_model_len` per sample;
- orca-pow2: the next power of two of the final length per sample;
- orca-oracle: exactly the final length per sample.

Contiguous allocators share nothing: every sample holds its own copy of the prompt, and a prefix
common to many requests is stored once per request. Beam search (beam4) is replayed as n=4
sampling: each beam holds its own growing sequence forked from the prompt. Real beams also fork
from each other at every step, so this is the paged allocator's worst case for beams.

η at a step is the physical slots holding token state over the slots reserved; a slot shared by
several sequences counts once (so η never exceeds 1). The report gives its mean over steps (the
vLLM paper's Figure 2) and the peak number of requests held at once.

Slots are also counted in bytes: those of one token's K and V in every layer of `--model` (default: the
embedded one) with its KV cache in `--kv-cache-dtype` (an int8 cache's scales included). `--kv-memory`
gives the budget in bytes instead of slots, so the same memory holds about twice the slots in int8.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import deque
from dataclasses import asdict, dataclass, field

from pagedllm.benchmarks.workloads import WORKLOADS, Workload, make_workload
from pagedllm.config import KV_CACHE_DTYPES, EngineConfig
from pagedllm.domains import (
    INT64_MAX,
    NON_NEGATIVE_INTS,
    POSITIVE_INTS,
    SEEDS,
    Choices,
    CommaLists,
    ExistingPaths,
    FolderPaths,
    Integers,
)
from pagedllm.kv.kv_cache_manager import BlockPair, KVCacheManager
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import resolve_model_folder
from pagedllm.worker.group import pool_size

# Token ids only decide which prefixes are equal; the lengths are what the replay measures.
VOCAB_SIZE = 49152
CONTIGUOUS = ("orca-max", "orca-pow2", "orca-oracle")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt: tuple[int, ...]
    output_len: int
    n: int = 1

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(slots=True)
class MemoryResult:
    """Per-step series of one allocator's replay: slots holding state, slots reserved, requests held."""

    allocator: str
    stored: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)

    @property
    def utilization(self) -> list[float]:
        return [s / r for s, r in zip(self.stored, self.reserved, strict=True)]

    @property
    def mean_utilization(self) -> float:
        return sum(self.utilization) / self.steps

    @property
    def peak_concurrency(self) -> int:
        return max(self.concurrency)

    @property
    def steps(self) -> int:
        return len(self.stored)

    def record(self, stored: int, reserved: int, concurrency: int) -> None:
        self.stored.append(stored)
        self.reserved.append(reserved)
        self.concurrency.append(concurrency)

    def to_json(self) -> dict:
        summary = {"mean_utilization": self.mean_utilization, "peak_concurrency": self.peak_concurrency}
        return asdict(self) | summary | {"steps": self.steps, "utilization": self.utilization}


def trace_from_workload(workload: Workload, max_model_len: int) -> list[TraceRequest]:
    """The workload's requests that fit `max_model_len`; beams count as samples (see the module doc)."""
    n = max(workload.n, workload.beam_width)
    return [TraceRequest(r.prompt, r.output_len, n) for r in workload.requests if r.final_len <= max_model_len]


def contiguous_reservation(policy: str, request: TraceRequest, max_model_len: int) -> int:
    """Slots reserved for one sample of `request`."""
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
    result = MemoryResult(policy)

    def reservation(index: int) -> int:
        return contiguous_reservation(policy, trace[index], max_model_len) * trace[index].n

    while waiting or lengths:
        for index in lengths:
            lengths[index] += 1
        while waiting and sum(reserved.values()) + reservation(waiting[0]) <= budget:
            index = waiting.popleft()
            reserved[index] = reservation(index)
            lengths[index] = trace[index].prompt_len + 1
        if not lengths:
            raise ValueError(f"a request does not fit a budget of {budget} slots under {policy}")
        stored = sum(length * trace[index].n for index, length in lengths.items())
        result.record(stored, sum(reserved.values()), len(lengths))
        for index in [i for i, length in lengths.items() if length >= trace[i].final_len]:
            del lengths[index], reserved[index]
    return result


def replay_paged(trace: list[TraceRequest], budget: int, block_size: int, sliding_window: int = 0) -> MemoryResult:
    """`sliding_window` > 0: a model whose every layer slides, so blocks its window has passed go back."""
    kv = KVCacheManager(budget // block_size, block_size, sliding_window=sliding_window)
    # A request that cannot fit alone would be admitted, grown and preempted forever.
    if any(kv.blocks_to_hold(r.final_len, r.prompt_len) * r.n > kv.num_blocks for r in trace):
        raise ValueError(f"a request does not fit a budget of {budget} slots in blocks of {block_size}")
    first_seq = list(itertools.accumulate((r.n for r in trace), initial=0))

    def seqs(index: int) -> range:
        return range(first_seq[index], first_seq[index + 1])

    waiting = deque(range(len(trace)))
    lengths: dict[int, int] = {}
    result = MemoryResult(f"paged-{block_size}" + (f"-w{sliding_window}" if sliding_window else ""))
    while waiting or lengths:
        for index in list(lengths):
            while index in lengths and not _grow(kv, seqs(index), lengths[index]):
                newest = max(lengths)  # preempt by recompute: the newest request gives its blocks back
                _release(kv, seqs(newest))
                del lengths[newest]
                waiting.appendleft(newest)
            if index in lengths:
                lengths[index] += 1
        while waiting and _admit(kv, trace[waiting[0]], seqs(waiting[0])):
            index = waiting.popleft()
            lengths[index] = trace[index].prompt_len + 1
        if not lengths:
            raise ValueError(f"a request does not fit a budget of {budget} slots in blocks of {block_size}")
        held = {seq: length for index, length in lengths.items() for seq in seqs(index)}
        result.record(_stored_slots(kv, held), kv.pool.num_used * block_size, len(lengths))
        for index in [i for i, length in lengths.items() if length >= trace[i].final_len]:
            _release(kv, seqs(index))
            del lengths[index]
    return result


def _admit(kv: KVCacheManager, request: TraceRequest, seqs: range) -> bool:
    """Prefill the prompt once (reusing cached prefix blocks), fork the other samples from it, and give
    every sample a slot for its first token; all or nothing."""
    parent, prompt = seqs[0], list(request.prompt)
    cached = kv.start_sequence(parent, prompt, salt=None)
    if kv.allocate_slots(parent, cached, request.prompt_len - cached, []):
        kv.register_computed(parent, prompt, request.prompt_len)
        for child in seqs[1:]:
            kv.fork(parent, child)
        if _grow(kv, seqs, request.prompt_len):
            return True
    _release(kv, seqs)
    return False


def _grow(kv: KVCacheManager, seqs: range, length: int) -> bool:
    """One more token per sample. A sample that already grew is a no-op on retry, so a caller may
    preempt another request and call again."""
    copies: list[BlockPair] = []  # copy-on-write of a shared last block; the replay has no tensors to copy
    return all(kv.allocate_slots(seq, length, 1, copies) for seq in seqs)


def _release(kv: KVCacheManager, seqs: range) -> None:
    for seq in seqs:
        kv.free(seq)


def _stored_slots(kv: KVCacheManager, lengths: dict[int, int]) -> int:
    """Distinct physical slots holding token state. Every block of a table but its last is full, and a
    shared block has the same fill in every table holding it (an append copies it first), so the used
    slots minus the empty tails of the distinct last blocks count each stored token once. Summing over
    every block instead would cost the length of every table at every step."""
    empty: dict[int, int] = {}
    for seq, length in lengths.items():
        table = kv.block_table(seq)
        empty[table[-1]] = len(table) * kv.block_size - length
    return kv.pool.num_used * kv.block_size - sum(empty.values())


def bytes_per_slot(model: str | None, kv_cache_dtype: str) -> int:
    """Bytes of one token's K and V in every layer of `model`'s KV pool, as the engine sizes it."""
    config = EngineConfig(model=model, kv_cache_dtype=kv_cache_dtype, block_size=1, num_kv_blocks=1)
    return pool_size(config, ModelConfig.from_folder(resolve_model_folder(model))).bytes_per_block


def run_all(
    trace: list[TraceRequest], budget: int, max_model_len: int, block_sizes: list[int], sliding_window: int = 0
) -> list[MemoryResult]:
    results = [replay_contiguous(trace, budget, policy, max_model_len) for policy in CONTIGUOUS]
    return results + [replay_paged(trace, budget, size, sliding_window) for size in block_sizes]


def add_bench_memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="synthetic", **Choices(WORKLOADS).flag_kwargs())
    parser.add_argument("--num-prompts", default=256, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument("--budget", default=32768, help="KV memory in token slots", **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--kv-memory",
        default=None,
        help="KV memory in bytes (instead of --budget): the slots it holds of --model in --kv-cache-dtype",
        **Integers(1, INT64_MAX).flag_kwargs(),
    )
    parser.add_argument(
        "--model",
        default=None,
        help="whose KV bytes a slot holds (default: the embedded SmolLM2-135M)",
        **ExistingPaths().flag_kwargs(),
    )
    parser.add_argument("--kv-cache-dtype", default="auto", **Choices(KV_CACHE_DTYPES).flag_kwargs())
    parser.add_argument("--max-model-len", default=2048, **POSITIVE_INTS.flag_kwargs())
    parser.add_argument(
        "--block-sizes",
        default=(1, 8, 16, 32, 64, 128),
        help="comma-separated",
        **CommaLists(POSITIVE_INTS).flag_kwargs(),
    )
    parser.add_argument("--seed", default=0, **SEEDS.flag_kwargs())
    parser.add_argument(
        "--sliding-window",
        default=0,
        help="tokens every layer sees back (paged allocators free the rest)",
        **NON_NEGATIVE_INTS.flag_kwargs(),
    )
    parser.add_argument(
        "--out", default=None, help="write memory.json (every series) and plots here", **FolderPaths().flag_kwargs()
    )


def run_bench_memory(args: argparse.Namespace) -> int:
    slot_bytes = bytes_per_slot(args.model, args.kv_cache_dtype)
    if args.kv_memory is not None:
        args.budget = args.kv_memory // slot_bytes
    workload = make_workload(args.workload, args.num_prompts, VOCAB_SIZE, args.max_model_len, args.seed)
    trace = trace_from_workload(workload, args.max_model_len)
    results = run_all(trace, args.budget, args.max_model_len, list(args.block_sizes), args.sliding_window)
    samples = f" x {trace[0].n} samples" if trace and trace[0].n > 1 else ""
    limits = f"budget {args.budget} token slots ({_mib(args.budget * slot_bytes)}), max_model_len {args.max_model_len}"
    print(f"{args.workload}: {len(trace)} requests{samples}, {limits}")
    print(f"KV cache {args.kv_cache_dtype}: {slot_bytes} bytes per token slot")
    print(format_table(results, slot_bytes))
    if args.out is not None:
        write_outputs(args, len(trace), results, slot_bytes)
    return 0


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def format_table(results: list[MemoryResult], slot_bytes: int) -> str:
    lines = [f"{'allocator':<12} {'mean η':>7} {'peak concurrency':>17} {'peak reserved':>14} {'steps':>6}"]
    for r in results:
        peak = _mib(max(r.reserved) * slot_bytes)
        lines.append(f"{r.allocator:<12} {r.mean_utilization:>7.1%} {r.peak_concurrency:>17} {peak:>14} {r.steps:>6}")
    return "\n".join(lines)


def write_outputs(args: argparse.Namespace, num_requests: int, results: list[MemoryResult], slot_bytes: int) -> None:
    # Imported here: matplotlib costs a noticeable part of the CLI's start, and only --out needs it.
    from pagedllm.benchmarks.plots import plot_memory

    args.out.mkdir(parents=True, exist_ok=True)
    run = {"workload": args.workload, "num_requests": num_requests, "budget": args.budget}
    run |= {"max_model_len": args.max_model_len, "seed": args.seed}
    run |= {"kv_cache_dtype": args.kv_cache_dtype, "bytes_per_slot": slot_bytes}
    (args.out / "memory.json").write_text(json.dumps(run | {"results": [r.to_json() for r in results]}) + "\n")
    plot_memory(results, args.out)
