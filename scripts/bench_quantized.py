"""Issue 26's three figures for one model and one way of holding its weights, in a fresh process each:
batch-1 decode time per token, output tokens per second of 16 requests at once, and the process's peak RSS.

    python scripts/bench_quantized.py MODEL.gguf [--dequantize] [--dtype bfloat16] [--kv-cache-memory BYTES]

Prompts are random token ids (speed does not depend on them) and every request runs to its length
(`ignore_eos`), as llama.cpp's `llama-bench` and `llama-batched-bench` do.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from dataclasses import asdict, dataclass

from pagedllm import LLM, SamplingParams


@dataclass(frozen=True)
class Figures:
    decode_ms_per_token: float
    batch_output_tok_s: float
    peak_rss_mb: float


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]} for _ in range(count)]


def decode_ms_per_token(llm: LLM, prompt: dict, tokens: int) -> float:
    """Time of the tokens after the first (the prompt's step), per token."""
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=0.0)
    llm.generate([prompt], first, use_tqdm=False)  # the prompt's pass, and warm-up
    start = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return (time.perf_counter() - start - prefill) / tokens * 1e3


def batch_tok_s(llm: LLM, prompts: list[dict], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, dequantize=args.dequantize, kv_cache_memory=args.kv_cache_memory)
    vocab = len(llm.engine.tokenizer)
    prompts = random_prompts(args.batch, args.prompt_tokens, vocab, seed=0)
    decode = decode_ms_per_token(llm, prompts[0], args.decode_tokens)
    batch_tok_s(llm, prompts[:2], 4)  # the batch path's warm-up
    batch = batch_tok_s(llm, prompts, args.batch_tokens)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(asdict(Figures(round(decode, 2), round(batch, 2), round(rss, 1)))))


if __name__ == "__main__":
    main()
