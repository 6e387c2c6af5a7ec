"""Seeded benchmark workloads, as token ids, shared by `bench throughput` and `bench memory`.

Every request asks for exactly `output_len` tokens (EOS ignored), so every engine does the same
work and output tok/s compares like with like. Token ids are drawn uniformly from the vocabulary:
no dataset to download, and the attention and GEMM work depends only on the lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Means of the ShareGPT conversations in the vLLM paper (Table 1 / Figure 11): 161 in, 338 out.
SHAREGPT_MEAN_INPUT = 161
SHAREGPT_MEAN_OUTPUT = 338
# Spread of the lognormal draws; ShareGPT lengths span about two orders of magnitude.
SHAREGPT_SIGMA = 1.0
SHARED_PREFIX_GROUPS = 8
SHARED_PREFIX_LEN = 512
MIN_LEN = 4
BEAM_OUTPUT_LEN = 64


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: tuple[int, ...]
    output_len: int

    @property
    def final_len(self) -> int:
        return len(self.prompt) + self.output_len


@dataclass(frozen=True, slots=True)
class Workload:
    """`n` samples per request (temperature 1.0 when n > 1) or beam search of `beam_width`."""

    name: str
    requests: tuple[BenchRequest, ...]
    n: int = 1
    beam_width: int = 1

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """Tokens returned to the user: n per request when sampling, one beam (the best) per request."""
        return sum(r.output_len for r in self.requests) * self.n

    @property
    def temperature(self) -> float:
        return 1.0 if self.n > 1 else 0.0


WORKLOADS = ("synthetic", "sharegpt-like", "shared-prefix", "parallel-n4", "beam4")


def make_workload(name: str, num_prompts: int, vocab_size: int, max_model_len: int, seed: int = 0) -> Workload:
    """The workload `name` with `num_prompts` requests (for shared-prefix: questions over 8 prefixes)."""
    rng = random.Random(seed)
    if name == "synthetic":
        return Workload(name, _uniform(rng, num_prompts, vocab_size, (32, 512), (16, 256)))
    if name == "sharegpt-like":
        return Workload(name, _sharegpt_like(rng, num_prompts, vocab_size, max_model_len))
    if name == "shared-prefix":
        return Workload(name, _shared_prefix(rng, num_prompts, vocab_size))
    if name == "parallel-n4":
        return Workload(name, _uniform(rng, num_prompts, vocab_size, (32, 512), (16, 256)), n=4)
    if name == "beam4":
        # One output length for all: beam search APIs (vLLM's, transformers') take a single max_tokens per call.
        return Workload(name, _uniform(rng, num_prompts, vocab_size, (32, 512), (BEAM_OUTPUT_LEN,) * 2), beam_width=4)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _tokens(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(count))


def _uniform(
    rng: random.Random, num: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> tuple[BenchRequest, ...]:
    return tuple(
        BenchRequest(_tokens(rng, rng.randint(*prompt_range), vocab_size), rng.randint(*output_range))
        for _ in range(num)
    )


def _lognormal(rng: random.Random, mean: float) -> int:
    # mu chosen so that the distribution's mean is `mean`: E[X] = exp(mu + sigma²/2).
    mu = math.log(mean) - SHAREGPT_SIGMA**2 / 2
    return max(MIN_LEN, round(rng.lognormvariate(mu, SHAREGPT_SIGMA)))


def _sharegpt_like(rng: random.Random, num: int, vocab_size: int, max_model_len: int) -> tuple[BenchRequest, ...]:
    requests = []
    for _ in range(num):
        prompt_len = min(_lognormal(rng, SHAREGPT_MEAN_INPUT), max_model_len // 2)
        output_len = min(_lognormal(rng, SHAREGPT_MEAN_OUTPUT), max_model_len - prompt_len)
        requests.append(BenchRequest(_tokens(rng, prompt_len, vocab_size), output_len))
    return tuple(requests)


def _shared_prefix(rng: random.Random, num: int, vocab_size: int) -> tuple[BenchRequest, ...]:
    """8 system prompts of 512 tokens; question i goes to prefix i % 8, in an interleaved order so
    that a cache must keep all eight prefixes."""
    prefixes = [_tokens(rng, SHARED_PREFIX_LEN, vocab_size) for _ in range(SHARED_PREFIX_GROUPS)]
    return tuple(
        BenchRequest(
            prefixes[i % SHARED_PREFIX_GROUPS] + _tokens(rng, rng.randint(16, 128), vocab_size), rng.randint(16, 128)
        )
        for i in range(num)
    )
