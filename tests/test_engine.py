"""Engine behaviour on a tiny model: accounting every step, utilization, refusals, stops, seeds, n, abort."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.config import EngineConfig
from tests.kv_invariants import check_kv_invariants


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=400)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 20, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def check_accounting(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv
    check_kv_invariants(kv)
    assert kv.pool.num_free + kv.pool.num_used == kv.num_blocks
    for group in engine.scheduler.running:
        for seq in group.live_seqs():
            held = kv.seqs.get(seq.seq_id)
            assert len(held.blocks if held else []) * kv.block_size >= seq.num_computed_tokens
    for group in engine.scheduler.waiting:
        assert not any(seq.seq_id in kv.seqs for seq in group.live_seqs())


def test_every_block_accounted_for_after_every_step_with_preemption(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=40))
    for i, prompt in enumerate(prompts_of([5, 30, 12, 60, 3, 44, 20, 9])):
        engine.add_request(str(i), prompt, greedy(max_tokens=25))
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
        check_accounting(engine)
    assert finished == {str(i) for i in range(8)}
    assert engine.stats().num_preemptions > 0
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks


def test_utilization_in_a_steady_batch_meets_the_paged_bound(tiny_llama):
    block_size = 16
    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", block_size=block_size))
    for i, prompt in enumerate(prompts_of([90, 100, 110, 120, 95, 105, 115, 125])):
        engine.add_request(str(i), prompt, greedy(max_tokens=60))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = [seq for group in engine.scheduler.running for seq in group.live_seqs()]
        if len(running) == 8 and all(seq.num_output_tokens > 0 for seq in running):
            mean_len = sum(seq.num_computed_tokens for seq in running) / len(running)
            assert engine.stats().kv_utilization >= 1 - (block_size - 1) / mean_len
            checked += 1
    assert checked > 30


def test_a_text_certainly_too_long_is_refused_before_it_is_tokenized(llm, monkeypatch):
    engine = llm.engine
    bound = engine.text_bound.chars_per_token * engine.max_model_len
    longest = max(map(len, engine.tokenizer.get_vocab()))
    assert engine.text_bound.chars_per_token in (longest, 4 * longest)
    encoded: list[int] = []
    real_encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or real_encode(text))
    with pytest.raises(ValueError, match=rf"prompt has {bound} characters, at least 400 tokens; max_model_len is 400"):
        engine.add_request("long", "a" * bound, SamplingParams(max_tokens=1))
    assert encoded == [] and not engine.has_unfinished_requests()
    # One character fewer may still fit: it is tokenized, and then judged by its tokens.
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens"):
        engine.add_request("long", "a" * (bound - 1), SamplingParams(max_tokens=1))
    assert encoded == [bound - 1]


def test_request_over_max_model_len_is_refused_with_both_lengths(llm):
    with pytest.raises(ValueError, match=r"390 tokens.*max_tokens \(20\).*max_model_len \(400\)"):
        llm.generate([[7] * 390], greedy(20), use_tqdm=False)


def test_request_larger_than_the_pool_is_refused(tiny_llama):
    small = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=8, max_model_len=400)
    with pytest.raises(ValueError, match="needs 10 KV blocks but the whole pool has 8"):
        small.generate([list(range(3, 23))], greedy(20), use_tqdm=False)
    assert small.generate([list(range(3, 13))], greedy(5), use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "prompt is empty"), ([5, 100000], "outside the vocabulary"), (3.5, "a prompt is")],
)
def test_bad_prompts_are_refused_and_nothing_is_left_behind(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hello there", prompt], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().kv_blocks_used == 0
    assert llm.generate("hello", greedy(3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_token_ids_the_sampler_indexes_with_must_be_in_the_vocabulary(llm, field):
    """Once a stop token id past the vocabulary reached the sampler's ban with min_tokens (an IndexError)."""
    params = {"stop_token_ids": [100000], "min_tokens": 2} if field == "stop_token_ids" else {"logit_bias": {100000: 1}}
    with pytest.raises(ValueError, match=f"{field} token id 100000 is outside the vocabulary"):
        llm.generate("hello", greedy(4, **params), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_forms_are_equivalent(llm):
    ids = llm.get_tokenizer().encode("A block table maps logical blocks")
    outs = llm.generate(["A block table maps logical blocks", ids, {"prompt_token_ids": ids}], greedy(), use_tqdm=False)
    assert outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_max_tokens_gives_length_and_incremental_text_equals_full_decode(llm):
    outs = llm.generate(prompts_of([4, 17, 33]), greedy(max_tokens=30), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 30
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_text_and_names_the_reason(llm):
    prompt = prompts_of([12], seed=3)
    full = llm.generate(prompt, greedy(30), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    cut = full.index(stop)
    out = llm.generate(prompt, greedy(30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:cut], "stop", stop)
    kept = llm.generate(prompt, greedy(30, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == full[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    prompt = prompts_of([9], seed=4)
    tokens = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[2]
    first = tokens.index(stop_id)
    out = llm.generate(prompt, greedy(20, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1] and out.stop_reason == stop_id
    late = llm.generate(prompt, greedy(20, stop_token_ids=[stop_id], min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 6 and stop_id not in late.token_ids[:6]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    prompt = prompts_of([10], seed=5)[0]
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(prompts_of([30, 5]) + [prompt], [others, others, params], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=4321, ignore_eos=True)
    assert llm.generate([prompt], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_equal_separate_requests_with_derived_seeds(llm):
    prompt = prompts_of([15], seed=6)[0]
    group = llm.generate([prompt], SamplingParams(n=3, seed=7, max_tokens=15, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in group.outputs] == [0, 1, 2]
    for i, completion in enumerate(group.outputs):
        single = SamplingParams(seed=7 + i, max_tokens=15, ignore_eos=True)
        assert completion.token_ids == llm.generate([prompt], single, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1


def test_logprobs_hold_the_sampled_token_and_the_top_k(llm):
    out = llm.generate(prompts_of([8]), greedy(10, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 10
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(entry) <= 4
        assert sorted(e.rank for e in entry.values())[:3] == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_abort_returns_blocks_and_engine_keeps_serving(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32"))
    engine.add_request("a", prompts_of([40])[0], greedy(50))
    engine.add_request("b", prompts_of([20])[0], greedy(5))
    engine.step()
    engine.step()
    assert engine.scheduler.kv.pool.num_used > 0
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["b"]
    assert engine.scheduler.kv.pool.num_used == 0


def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "Hello world"}]
    out = llm.chat(conversation, greedy(5), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert len(llm.chat([conversation, conversation], greedy(5), use_tqdm=False)) == 2


def test_engine_options_are_validated_with_the_field_named():
    import torch

    for bad, field in [({"device": "tpu"}, "device"), ({"preemption_mode": "drop"}, "preemption_mode")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            EngineConfig(device="cuda")


def test_a_decode_steps_message_from_the_core_does_not_grow_with_the_context(tmp_path):
    """The engine core sends each step's change only: a decode step of a sequence of 4096 tokens costs the
    pipe what one of 256 tokens does (a whole output would carry every prompt id and all the text)."""
    import pickle

    from pagedllm.entrypoints.openai.engine_core import StepDeltas
    from tests.conftest import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "long", max_position_embeddings=4200)
    engine = LLMEngine(EngineConfig(model=folder, dtype="float32", max_model_len=4200), process_outputs=False)
    sizes = []
    for length in (256, 4096):
        [prompt] = prompts_of([length], seed=length)
        engine.add_request(f"{length:04d}", prompt, greedy(6, logprobs=2))
        steps = []
        while engine.has_unfinished_requests():
            step = engine.step_core()
            steps.append(len(pickle.dumps(StepDeltas(step.deltas, {}, 0.0))))
        sizes.append(steps[-2])  # a decode step (the last also says the request finished)
        assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
    assert abs(sizes[0] - sizes[1]) <= 16, sizes
    with pytest.raises(RuntimeError, match="step_core"):
        engine.step()
