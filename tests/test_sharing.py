"""Memory sharing end to end on a tiny model: prefix caching, preemption by recompute and by swap,
parallel samples forked on shared blocks, best_of, and beam search against a reference over
`transformers` logits."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, BeamSearchParams, SamplingParams


def prompts_of(lengths: list[int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 380) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
PROMPTS = prompts_of([5, 30, 12, 60, 3, 44, 20, 9])


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    """No sharing of any kind and no preemption."""
    llm = LLM(model=tiny_llama, dtype="float32", enable_prefix_caching=False)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_prefix_caching_gives_the_same_tokens_and_serves_the_shared_prefix(tiny_llama):
    shared = prompts_of([64], seed=9)[0]
    prompts = prompts_of([7, 20, 33, 2], seed=10, prefix=shared)
    off = LLM(model=tiny_llama, dtype="float32", enable_prefix_caching=False)
    on = LLM(model=tiny_llama, dtype="float32", block_size=16)
    expected = token_ids(off.generate(prompts, GREEDY, use_tqdm=False))
    assert token_ids(on.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(on.generate(prompts[1:], GREEDY, use_tqdm=False)) == expected[1:]
    stats = on.stats()
    # After the first request, each later one finds the 64-token prefix (4 full blocks) in the cache.
    assert stats.prefix_cache_hits >= 3 * 64
    assert stats.prefix_cache_hit_rate == pytest.approx(stats.prefix_cache_hits / stats.prefix_cache_queries)
    assert stats.kv_blocks_used == 0


def test_a_hit_never_covers_the_last_prompt_token(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    prompt = prompts_of([16], seed=11)[0]  # exactly 4 full blocks
    first = token_ids(llm.generate([prompt], GREEDY, use_tqdm=False))
    again = token_ids(llm.generate([prompt], GREEDY, use_tqdm=False))
    assert first == again
    assert llm.stats().prefix_cache_hits == 12  # 3 blocks; the 4th holds the last prompt token


def test_each_output_says_how_many_of_its_prompt_tokens_the_cache_served(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    prompt = prompts_of([16], seed=13)[0]
    (first,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    (again,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 12)


def test_different_cache_salts_never_share(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    prompt = prompts_of([20], seed=12)[0]
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "alice"}], GREEDY, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "bob"}], GREEDY, use_tqdm=False)
    assert llm.stats().prefix_cache_hits == 0
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "alice"}], GREEDY, use_tqdm=False)
    assert llm.stats().prefix_cache_hits == 16


def test_reset_prefix_cache_forgets_and_is_refused_while_blocks_are_in_use(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    prompt = prompts_of([20], seed=13)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.engine.add_request("busy", prompt, GREEDY)
    llm.engine.step()
    with pytest.raises(RuntimeError, match="in use"):
        llm.reset_prefix_cache()
    llm.engine.abort_request("busy")
    llm.reset_prefix_cache()
    hits = llm.stats().prefix_cache_hits
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.stats().prefix_cache_hits == hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_tokens(tiny_llama, baseline, mode):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=40, preemption_mode=mode, swap_space=0.01)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions > 0) == (mode == "swap")
    assert stats.kv_blocks_used == 0 and stats.num_swapped_out_blocks == 0


def test_swap_falls_back_to_recompute_when_cpu_space_is_full(tiny_llama, baseline):
    llm = LLM(
        model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=40, preemption_mode="swap", swap_space=1e-6
    )
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert llm.stats().num_preemptions > 0 and llm.stats().num_swap_preemptions == 0


def test_n4_shares_the_prompt_and_equals_four_requests_with_derived_seeds(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    prompt = prompts_of([30], seed=14)[0]
    group = llm.generate([prompt], SamplingParams(n=4, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stats = llm.stats()
    assert stats.num_cow_copies > 0  # the shared partial prompt block was copied on first write
    singles = [SamplingParams(seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(4)]
    separate = llm.generate([prompt] * 4, singles, use_tqdm=False)
    assert [c.token_ids for c in group.outputs] == [out.outputs[0].token_ids for out in separate]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_requests_survive_preemption(tiny_llama, mode):
    params = SamplingParams(n=3, seed=5, max_tokens=20, ignore_eos=True)
    prompts = prompts_of([10, 25, 18], seed=15)
    roomy = LLM(model=tiny_llama, dtype="float32", block_size=4)
    tight = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=30, preemption_mode=mode)
    expected = [[c.token_ids for c in out.outputs] for out in roomy.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in out.outputs] for out in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.stats().num_preemptions > 0 and tight.stats().kv_blocks_used == 0


def test_best_of_returns_the_n_most_likely_samples(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32")
    prompt = prompts_of([12], seed=16)[0]
    out = llm.generate([prompt], SamplingParams(n=2, best_of=5, seed=3, max_tokens=10, ignore_eos=True), use_tqdm=False)
    every = llm.generate(
        [prompt], SamplingParams(n=5, seed=3, max_tokens=10, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    scores = sorted((c.cumulative_logprob for c in every[0].outputs), reverse=True)
    assert len(out[0].outputs) == 2
    assert sorted(c.cumulative_logprob for c in out[0].outputs) == pytest.approx(sorted(scores[:2]), abs=1e-4)


def reference_beam_search(folder, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float):
    """Plain beam search over `transformers` logits, with vLLM's rules: each beam offers its top 2·width
    tokens, the best `width` candidates survive, EOS candidates finish, score = cum / len ** penalty."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    beams, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            top = logprobs.topk(2 * width)
            candidates += [
                (tokens + [t], cum + lp) for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
            ]
        candidates.sort(key=lambda c: c[1], reverse=True)
        beams = []
        for tokens, cum in candidates[:width]:
            (finished if tokens[-1] == eos else beams).append((tokens, cum))
        if not beams:
            break
    finished += beams

    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty

    return sorted(finished, key=score, reverse=True)[:width]


def test_beam_search_whose_every_beam_ends_at_the_first_token(tiny_llama, tmp_path):
    """Every beam's first pick is EOS: the search ends with that one finished beam and no live sequence
    left (a request whose group had none left failed with an IndexError), and the engine serves on."""
    prompt = prompts_of([11], seed=5)[0]
    first = (
        LLM(model=tiny_llama, dtype="float32")
        .generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
        .outputs[0]
        .token_ids[0]
    )
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    llm = LLM(model=folder, dtype="float32", block_size=4)
    [result] = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=8))
    assert result.finished
    assert [(c.token_ids, c.finish_reason) for c in result.outputs] == [([first], "stop")]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert again.token_ids[0] == first and again.finish_reason == "stop"
    assert llm.stats().kv_blocks_used == 0


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_a_reference_beam_search(tiny_llama, length_penalty):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4)
    eos = llm.get_tokenizer().eos_token_id
    prompts = prompts_of([9, 17], seed=17)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty)
    results = llm.beam_search(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        expected = reference_beam_search(tiny_llama, prompt, 3, 8, eos, length_penalty)
        assert [c.token_ids for c in result.outputs] == [tokens[len(prompt) :] for tokens, _ in expected]
        for completion, (_, cum) in zip(result.outputs, expected, strict=True):
            assert math.isclose(completion.cumulative_logprob, cum, abs_tol=1e-3)
            assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    stats = llm.stats()
    assert stats.num_cow_copies > 0 and stats.kv_blocks_used == 0
