"""Memory sharing, measured: prefix caching, forks (parallel sampling, beam search), preemption modes.

    python scripts/bench_sharing.py [--model PATH] [--part prefix|forks|preemption|all] [--json PATH]

(a) prefix: 8 system prompts of 512 tokens x 16 questions of 32-64 tokens, shuffled, 32 output
    tokens each; prefix caching on vs off: prompt tokens computed, mean time to first token
    (all requests arrive at once), throughput.
(b) forks: n=4 parallel sampling and beam width 4 on synthetic prompts: peak KV blocks held vs
    the blocks the same sequences would hold without sharing, at the same moment.
(c) preemption: a workload under a pool too small for it, recompute vs swap: throughput and
    preemption counts.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from pagedllm import LLM, BeamSearchParams, SamplingParams


@dataclass(slots=True)
class PrefixResult:
    caching: bool
    prompt_tokens: int
    prompt_tokens_computed: int
    cache_hit_rate: float
    mean_ttft_s: float
    seconds: float
    output_tok_per_s: float


@dataclass(slots=True)
class ForkResult:
    workload: str
    peak_blocks_shared: int
    peak_blocks_unshared: int
    saved_fraction: float
    cow_copies: int


@dataclass(slots=True)
class PreemptionResult:
    mode: str
    seconds: float
    output_tok_per_s: float
    preemptions: int
    swap_preemptions: int


def shared_prefix_workload(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(512)] for _ in range(8)]
    prompts = [
        system + [rng.randrange(vocab) for _ in range(rng.randint(32, 64))] for system in systems for _ in range(16)
    ]
    rng.shuffle(prompts)
    return prompts


def run_prefix(model: str | None, caching: bool, seed: int) -> PrefixResult:
    llm = LLM(model=model, enable_prefix_caching=caching)
    engine = llm.engine
    prompts = shared_prefix_workload(engine.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    stats = engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    return PrefixResult(
        caching,
        prompt_tokens,
        prompt_tokens - stats.prefix_cache_hits,
        stats.prefix_cache_hit_rate,
        sum(first_token.values()) / len(first_token),
        seconds,
        32 * len(prompts) / seconds,
    )


def run_forks(llm: LLM, workload: str, seed: int) -> ForkResult:
    engine = llm.engine
    rng = random.Random(seed)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(16)]
    cow_before = engine.stats().num_cow_copies
    for i, prompt in enumerate(prompts):
        if workload == "parallel-n4":
            engine.add_request(f"{workload}{i}", prompt, SamplingParams(n=4, max_tokens=128, ignore_eos=True, seed=i))
        else:
            engine.add_beam_request(f"{workload}{i}", prompt, BeamSearchParams(beam_width=4, max_tokens=64))
    peak_shared = peak_unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak_shared = max(peak_shared, stats.kv_blocks_used)
        peak_unshared = max(peak_unshared, stats.kv_blocks_used + stats.blocks_saved_by_sharing)
    return ForkResult(
        workload,
        peak_shared,
        peak_unshared,
        1 - peak_shared / peak_unshared,
        engine.stats().num_cow_copies - cow_before,
    )


def run_preemption(model: str | None, mode: str, seed: int) -> PreemptionResult:
    llm = LLM(model=model, num_kv_blocks=400, preemption_mode=mode, swap_space=1.0, enable_prefix_caching=False)
    rng = random.Random(seed)
    prompts = [[rng.randrange(llm.engine.vocab_size) for _ in range(rng.randint(64, 256))] for _ in range(48)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    return PreemptionResult(
        mode, seconds, 128 * len(prompts) / seconds, stats.num_preemptions, stats.num_swap_preemptions
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--part", choices=("prefix", "forks", "preemption", "all"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, list] = {}
    if args.part in ("prefix", "all"):
        report["prefix"] = [asdict(run_prefix(args.model, caching, args.seed)) for caching in (False, True)]
        for row in report["prefix"]:
            print(
                f"prefix caching {'on ' if row['caching'] else 'off'}: {row['prompt_tokens_computed']}/"
                f"{row['prompt_tokens']} prompt tokens computed (hit rate {row['cache_hit_rate']:.1%}), "
                f"mean TTFT {row['mean_ttft_s']:.2f} s, {row['seconds']:.1f} s, {row['output_tok_per_s']:.1f} out tok/s"
            )
    if args.part in ("forks", "all"):
        llm = LLM(model=args.model, enable_prefix_caching=False)
        report["forks"] = [asdict(run_forks(llm, workload, args.seed)) for workload in ("parallel-n4", "beam4")]
        for row in report["forks"]:
            print(
                f"{row['workload']}: peak blocks {row['peak_blocks_shared']} shared vs "
                f"{row['peak_blocks_unshared']} unshared: {row['saved_fraction']:.1%} saved, "
                f"{row['cow_copies']} copy-on-write copies"
            )
    if args.part in ("preemption", "all"):
        report["preemption"] = [asdict(run_preemption(args.model, mode, args.seed)) for mode in ("recompute", "swap")]
        for row in report["preemption"]:
            print(
                f"preemption by {row['mode']}: {row['seconds']:.1f} s, {row['output_tok_per_s']:.1f} out tok/s, "
                f"{row['preemptions']} preemptions ({row['swap_preemptions']} by swap)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
