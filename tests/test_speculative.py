"""Speculative decoding (n-gram proposals): the output is token for token the output without it, greedy or seeded,
under batching, chunked prefill, prefix-cache hits, both preemption modes, stop strings and grammars; the guesses
the target rejects give their slots back; and the counts say how many were accepted."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import httpx
import pytest

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.kv.kv_cache_manager import blocks_needed
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.speculative import SpeculativeConfig, propose_ngram
from tests.conftest import save_tiny_llama
from tests.test_engine import check_accounting
from tests.test_server import start_server, stop_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def grounded_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span of themselves, some with a shared prefix: an n-gram finds guesses in them,
    and a tiny random model's greedy output soon repeats itself too."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 380) for _ in range(20)]
    prompts = []
    for i in range(count):
        span = [rng.randrange(3, 380) for _ in range(rng.randrange(4, 12))]
        filler = [rng.randrange(3, 380) for _ in range(rng.randrange(1, 30))]
        prompts.append((shared if i % 2 else []) + span + filler + span + filler[:2])
    return prompts


def run(folder, prompts, params, speculative: dict | None, **options) -> tuple[list, LLMEngine]:
    """Every request's completions, stepping one engine and checking its blocks after every step."""
    engine = LLMEngine(EngineConfig(model=folder, dtype="float32", speculative_config=speculative, **options))
    params = params if isinstance(params, list) else [params] * len(prompts)
    engine.add_requests([(str(i), prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))])
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        check_accounting(engine)
        check_tables_end_at_the_computed_tokens(engine)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks, "every block comes back"
    return [outputs[str(i)].outputs for i in range(len(prompts))], engine


def check_tables_end_at_the_computed_tokens(engine: LLMEngine) -> None:
    """Between steps a running sequence's table holds the blocks of its computed tokens and no more: the slots
    of rejected guesses were given back."""
    kv = engine.scheduler.kv
    for group in engine.scheduler.running:
        for seq in group.live_seqs():
            record = kv.seqs[seq.seq_id]
            assert record.num_tokens == seq.num_computed_tokens
            assert len(record.blocks) == blocks_needed(seq.num_computed_tokens, kv.block_size)


def tokens(completions: list) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in request] for request in completions]


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# ---- the proposer and the settings ----------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 1, 3) == [7, 5]  # latest of the two matches
    assert propose_ngram([4, 2, 3, 8, 1, 2, 3], 3, 1, 3) == [8, 1, 2]  # 3-gram absent: the 2-gram "2 3"
    assert propose_ngram([5, 6, 7, 8, 6], 5, 1, 3) == [7, 8, 6]  # fewer than k left after the match
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # the suffix never occurred before
    assert propose_ngram([1, 2, 1, 2], 2, 3, 3) == []  # only n-grams of at least prompt_lookup_min count
    assert propose_ngram([7], 2, 1, 3) == []


def test_settings_take_vllms_names_and_defaults():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model, got 'eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
        ({"model": "no-such-draft.gguf", "num_speculative_tokens": 2}, "model must be an existing folder"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' needs 'model'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
            "speculative_config must be a JSON object with keys among method.*'lookahead'",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(tiny_llama, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama, speculative_config=settings)


# ---- the output is the output without speculation -------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 24},  # chunked prefill beside speculating sequences
        {"block_size": 4, "num_kv_blocks": 48},  # preempted and recomputed
        {"block_size": 4, "num_kv_blocks": 48, "preemption_mode": "swap", "swap_space": 0.01},
    ],
    ids=["batch", "chunked", "recompute", "swap"],
)
def test_greedy_output_equals_the_output_without_speculation(tiny_llama, options):
    prompts = grounded_prompts(8)
    plain, _ = run(tiny_llama, prompts, greedy(), None, **options)
    fast, engine = run(tiny_llama, prompts, greedy(), NGRAM, **options)
    assert tokens(fast) == tokens(plain)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert 1 < stats.spec_mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0


PARAGRAPH = (
    "The paged attention algorithm stores the key and value cache in fixed size blocks. Each sequence has a block "
    "table that maps its logical blocks to physical blocks in a shared pool, so memory is allocated on demand and "
    "freed as soon as a request finishes."
)
TYPOS = [
    {
        "role": "user",
        "content": "Correct the typos in this paragraph and repeat it:\n\n" + PARAGRAPH.replace("the", "teh"),
    }
]
COPYING = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def default_models() -> tuple[LLM, LLM]:
    """The default model in float32 without and with n-gram speculation: fresh engines (the first test counts
    their steps). Float products: a verifying step's logprobs then equal a decode step's up to summation order,
    where int16 activations would let a last-bit difference cross a quantization step now and then."""
    options = dict(dtype="float32", num_kv_blocks=128, int16_activations=False)
    return LLM(**options), LLM(**options, speculative_config=COPYING)


def test_the_default_model_copying_its_input_accepts_most_guesses_and_hits_the_prefix_cache(default_models):
    """Input-grounded work on the real model: the same answer in well under the steps, and a second request with
    the same prompt finds its blocks (only accepted tokens' full blocks were registered)."""
    plain, fast = default_models
    params = SamplingParams(temperature=0.0, max_tokens=60)
    before, plain_before = fast.stats(), plain.stats()
    expected = plain.chat(TYPOS, params, use_tqdm=False)[0].outputs[0]
    first = fast.chat(TYPOS, params, use_tqdm=False)[0].outputs[0]
    assert first.token_ids == expected.token_ids and first.text == expected.text
    stats = fast.stats()
    drafts = stats.spec_num_drafts - before.spec_num_drafts
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 1 + accepted / drafts > 2.5, stats  # the mean accepted length of this request
    steps, plain_steps = stats.num_steps - before.num_steps, plain.stats().num_steps - plain_before.num_steps
    assert steps < 0.6 * plain_steps, (steps, plain_steps)
    again = fast.chat(TYPOS, params, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == expected.token_ids
    assert fast.stats().prefix_cache_hits > stats.prefix_cache_hits
    assert fast.stats().kv_blocks_used == 0


def test_seeded_sampling_draws_the_same_tokens_with_speculation(tiny_llama):
    prompts = grounded_prompts(6, seed=2)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=10, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.3, top_k=5, seed=11, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.5, repetition_penalty=1.2, presence_penalty=0.2, seed=12, max_tokens=40),
        SamplingParams(temperature=0.4, min_p=0.1, n=2, seed=13, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.2, seed=14, max_tokens=40, ignore_eos=True, min_tokens=30),
        greedy(40, frequency_penalty=0.5),
    ]
    plain, _ = run(tiny_llama, prompts, params, None)
    fast, engine = run(tiny_llama, prompts, params, NGRAM)
    assert tokens(fast) == tokens(plain)
    for slow_request, fast_request in zip(plain, fast, strict=True):
        for slow, quick in zip(slow_request, fast_request, strict=True):
            assert quick.text == slow.text
            if slow.logprobs is not None:
                assert [set(entry) for entry in quick.logprobs] == [set(entry) for entry in slow.logprobs]
                assert quick.cumulative_logprob == pytest.approx(slow.cumulative_logprob, abs=1e-3)
    assert engine.stats().spec_num_accepted_tokens > 0


def test_a_grammar_constrained_output_equals_the_output_without_speculation(tiny_llama):
    prompts = grounded_prompts(4, seed=4)
    constraint = StructuredOutputsParams(regex="(ab|ba)+c(ab|ba)+")
    params = [greedy(30, structured_outputs=constraint) for _ in prompts] + [greedy(30)]
    prompts = prompts + grounded_prompts(1, seed=5)
    plain, _ = run(tiny_llama, prompts, params, None)
    fast, engine = run(tiny_llama, prompts, params, NGRAM)
    assert tokens(fast) == tokens(plain)
    assert [request[0].text for request in fast] == [request[0].text for request in plain]
    assert engine.stats().spec_num_drafts > 0


def test_speculation_stops_above_its_batch_size(tiny_llama):
    prompts = grounded_prompts(6, seed=6)
    _, engine = run(tiny_llama, prompts, greedy(20), NGRAM | {"disable_by_batch_size": 5})
    # Six sequences run together until the first finish; none of them speculates before.
    assert engine.stats().spec_num_drafts == 0
    _, engine = run(tiny_llama, prompts[:5], greedy(20), NGRAM | {"disable_by_batch_size": 5})
    assert engine.stats().spec_num_drafts > 0


def test_beam_search_and_n_samples_run_beside_speculation(tiny_llama):
    """Beams do not speculate; best_of forks at the first token, then each sample speculates on its own."""
    prompts = grounded_prompts(4, seed=7)
    params = [
        SamplingParams(n=3, best_of=4, seed=3, max_tokens=20),
        greedy(20),
        greedy(20, min_tokens=5),
        BeamSearchParams(beam_width=2, max_tokens=8),
    ]
    plain, _ = run(tiny_llama, prompts, params, None)
    fast, engine = run(tiny_llama, prompts, params, NGRAM)
    assert tokens(fast) == tokens(plain)
    assert engine.stats().spec_num_drafts > 0


def test_a_stop_string_inside_accepted_guesses_drops_the_tokens_after_it(default_models):
    """The real model copying its input accepts several guesses a step, so a stop string often ends inside them:
    the tokens after it are dropped, as if they had never been picked."""
    plain, fast = default_models
    params = SamplingParams(temperature=0.0, max_tokens=60, logprobs=1)
    full = plain.chat(TYPOS, params, use_tqdm=False)[0].outputs[0].text
    for stop in ("blocks", "pool", "memory"):
        assert stop in full
        stopped = SamplingParams(temperature=0.0, max_tokens=60, logprobs=1, stop=[stop])
        expected = plain.chat(TYPOS, stopped, use_tqdm=False)[0].outputs[0]
        got = fast.chat(TYPOS, stopped, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.stop_reason) == (expected.text, expected.token_ids, stop)
        assert len(got.logprobs) == len(got.token_ids)
        assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-4)
    assert fast.stats().kv_blocks_used == 0


# ---- served ---------------------------------------------------------------------------------------


def test_the_server_speculates_and_counts_it_in_metrics(tiny_llama, tmp_path):
    prompts = grounded_prompts(8)  # the batch test's: some guesses are accepted
    expected, _ = run(tiny_llama, prompts, greedy(40), None)
    log = tmp_path / "server.log"
    server = start_server(tiny_llama, log, "--speculative-config", json.dumps(NGRAM))
    try:
        for prompt, completions in zip(prompts, expected, strict=True):
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 1}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == completions[0].text
        metrics = server.wait_for("pagedllm:spec_decode_num_drafts_total", lambda v: v > 0)
        assert metrics > 0
        drafted = server.metric("pagedllm:spec_decode_num_draft_tokens_total")
        accepted = server.metric("pagedllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < drafted
        assert server.metric("pagedllm:spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
        snapshot = httpx.get(f"{server.url}/kv/snapshot", timeout=10).json()  # what the KV page shows
        assert (snapshot["spec_num_draft_tokens"], snapshot["spec_num_accepted_tokens"]) == (drafted, accepted)
    finally:
        assert stop_server(server) == 0, log.read_text()


def test_the_command_line_refuses_bad_settings_naming_them(tiny_llama):
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm", "generate", "--model", str(tiny_llama), "--speculative-config", bad, "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "num_speculative_tokens must be an integer from 1 to 32, got 0" in result.stderr
    not_json = subprocess.run(
        [sys.executable, "-m", "pagedllm", "generate", "--speculative-config", "{method: ngram}", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert not_json.returncode == 2 and "--speculative-config" in not_json.stderr


def test_speculation_under_tensor_parallelism_equals_one_process(tiny_llama):
    prompts = [{"prompt_token_ids": prompt} for prompt in grounded_prompts(8)]
    options = {"model": tiny_llama, "dtype": "float32", "speculative_config": NGRAM}
    expected = LLM(**options).generate(prompts, greedy(), use_tqdm=False)
    llm = LLM(**options, tensor_parallel_size=2)
    got = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.stats().spec_num_accepted_tokens > 0
    llm.engine.shutdown()


# ---- a draft model --------------------------------------------------------------------------------


def draft(folder) -> dict:
    return {"model": str(folder), "num_speculative_tokens": 4}


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 24}, {"block_size": 4, "num_kv_blocks": 48}],
    ids=["batch", "chunked", "recompute"],
)
def test_a_draft_identical_to_the_target_has_every_guess_accepted(tiny_llama, options):
    """The accounting test: the same weights guess exactly what the target picks (greedy, float32)."""
    prompts = grounded_prompts(6, seed=9)
    plain, _ = run(tiny_llama, prompts, greedy(30), None, **options)
    fast, engine = run(tiny_llama, prompts, greedy(30), draft(tiny_llama), **options)
    assert tokens(fast) == tokens(plain)
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_draft_that_guesses_wrong_still_gives_the_exact_output(tiny_llama, tmp_path, mode):
    other = save_tiny_llama(tmp_path / "other", seed=5)  # same tokenizer, other weights
    prompts = grounded_prompts(6, seed=10)
    params = [greedy(30), SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True)] * 3
    options = {"block_size": 4, "num_kv_blocks": 48, "preemption_mode": mode, "swap_space": 0.01}
    plain, _ = run(tiny_llama, prompts, params, None, **options)
    fast, engine = run(tiny_llama, prompts, params, draft(other), **options)
    assert tokens(fast) == tokens(plain)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens and stats.num_preemptions > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    other = save_tiny_llama(tmp_path / "other", vocab_size=400)
    with pytest.raises(ValueError, match="another vocabulary"):
        LLM(model=tiny_llama, speculative_config=draft(other))
    with pytest.raises(ValueError, match="draft model runs on one rank"):
        LLM(model=tiny_llama, speculative_config=draft(tiny_llama), tensor_parallel_size=2)


def test_sampled_sequences_follow_the_targets_own_probabilities(tiny_llama):
    """Chi-square of (t1, t2, t3) drawn at temperature 1 with top-k 3 against the target's probabilities from
    transformers; the draft is the target, so the third token often comes from a guessed row and sometimes not."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, top_k, draws = grounded_prompts(1, seed=12)[0], 3, 3000
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    expected: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, mass in expected.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            top = logits.topk(top_k)
            for token, p in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
                grown[prefix + (token,)] = mass * p
        expected = grown
    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=i, max_tokens=3, ignore_eos=True) for i in range(draws)]
    spec = draft(tiny_llama) | {"num_speculative_tokens": 2, "disable_by_batch_size": draws + 1}
    completions, engine = run(tiny_llama, [prompt] * draws, params, spec)
    counts: dict[tuple[int, ...], int] = {}
    for request in completions:
        counts[tuple(request[0].token_ids)] = counts.get(tuple(request[0].token_ids), 0) + 1
    assert set(counts) <= set(expected), "a sequence outside the top-k support"
    # Pool the cells expected fewer than 5 times, as the test's approximation needs.
    big = [cell for cell, p in expected.items() if p * draws >= 5]
    pooled_p = 1.0 - sum(expected[cell] for cell in big)
    pooled_n = draws - sum(counts.get(cell, 0) for cell in big)
    cells = [(counts.get(cell, 0), expected[cell] * draws) for cell in big] + [(pooled_n, pooled_p * draws)]
    chi2 = sum((seen - want) ** 2 / want for seen, want in cells if want > 0)
    assert chi2 < 3 * (len(cells) - 1) + 30, (chi2, cells)
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
