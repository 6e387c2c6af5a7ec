"""Greedy float32 outputs equal `transformers`' own greedy generate, token for token."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from tests.reference import compare_greedy, reference_greedy

MAX_NEW = 24


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 15, 16, 17, 33, 60, 100, 7, 48][:count]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_engine(folder, prompts, **engine_kwargs):
    llm = LLM(model=folder, dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def assert_matches(outputs, refs) -> None:
    result = compare_greedy(outputs, refs)
    print(f"{result.exact}/{len(refs)} sequences matched exactly, {result.near_ties} near-ties")
    result.require(len(refs))


@pytest.fixture(scope="module")
def tiny_case(tiny_llama):
    prompts = random_prompts(10, 380)
    return tiny_llama, prompts, reference_greedy(tiny_llama, prompts, MAX_NEW)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_tiny_llama_batch_matches_transformers(tiny_case, block_size):
    folder, prompts, refs = tiny_case
    llm, outputs = run_engine(folder, prompts, block_size=block_size)
    assert_matches(outputs, refs)
    assert llm.stats().kv_blocks_used == 0


def test_chunked_prefill_matches_transformers(tiny_case):
    folder, prompts, refs = tiny_case
    _, outputs = run_engine(folder, prompts, max_num_batched_tokens=20)
    assert_matches(outputs, refs)


def test_preemption_by_recompute_matches_transformers(tiny_case):
    folder, prompts, refs = tiny_case
    # 10 sequences of up to 124 tokens cannot all live in 24 blocks of 8: some must be preempted.
    llm, outputs = run_engine(folder, prompts, block_size=8, num_kv_blocks=24)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert_matches(outputs, refs)
    assert stats.kv_blocks_used == 0


def test_tied_embeddings_gqa8_rope_scaling_match_transformers(tiny_llama_tied_gqa8):
    prompts = random_prompts(8, 380, seed=1)
    refs = reference_greedy(tiny_llama_tied_gqa8, prompts, MAX_NEW)
    _, outputs = run_engine(tiny_llama_tied_gqa8, prompts)
    assert_matches(outputs, refs)
