"""Constrained decoding, prompt log-probabilities and logit bias in the engine, on a tiny random model: a
random model writes nonsense, so every output that still fits its constraint shows the mask at work."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.kv_invariants import check_kv_invariants

PERSON = {
    "type": "object",
    "properties": {
        # A random model's bytes may decode to overlong UTF-8, which xgrammar counts as fewer characters
        # than Python does: an ASCII pattern keeps the length check exact here.
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["fox", "dog", "block"]}, "minItems": 1, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "home"],
    "additionalProperties": False,
}
PROMPTS = [
    "The quick brown fox",
    "Paged attention stores the key value cache",
    "A block table maps",
    "Copy on write keeps shared blocks safe",
]


def constrained(**constraint) -> StructuredOutputsParams:
    return StructuredOutputsParams(**constraint)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", block_size=4)


def test_json_schema_holds_for_every_sample(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120, structured_outputs=constrained(json=PERSON))
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), PERSON)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (constrained(regex=r"[a-z]{2,5}-\d{3}"), lambda text: re.fullmatch(r"[a-z]{2,5}-\d{3}", text)),
        (constrained(choice=["fox", "lazy dog", "block"]), lambda text: text in ("fox", "lazy dog", "block")),
        (
            constrained(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
            lambda text: re.fullmatch(r"\(\d+(\+\d+)*\)", text),
        ),
        (constrained(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]
    for spec, check in cases:
        # A random model may wander inside JSON for ever (a string that never closes): this seed's samples do not.
        params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=200, structured_outputs=spec)
        for completion in llm.generate(PROMPTS[:2], params, use_tqdm=False)[0].outputs:
            assert completion.finish_reason == "stop", (spec, completion)
            assert check(completion.text), (spec, completion.text)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    spec = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=constrained(regex=r"\d+"))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 4 + [spec] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch(r"\d+", o.outputs[0].text) for o in mixed[4:])


def test_a_finished_structure_stops_even_with_ignore_eos_and_min_tokens(llm):
    params = SamplingParams(
        temperature=1.0,
        seed=1,
        ignore_eos=True,
        min_tokens=10,
        max_tokens=50,
        structured_outputs=constrained(choice=["fox"]),
    )
    (completion,) = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs
    assert (completion.text, completion.finish_reason) == ("fox", "stop")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraints_survive_forks_and_preemption(tiny_llama, mode):
    # 140 blocks hold one request's four samples at their longest, not eight requests' at once.
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, num_kv_blocks=140, preemption_mode=mode, swap_space=0.05)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=120, structured_outputs=constrained(json=PERSON))
    outputs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions > 0) == (mode == "swap")
    assert stats.kv_blocks_used == 0
    for output in outputs:
        assert len(output.outputs) == 4
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), PERSON)


def test_best_of_keeps_its_constraint(llm):
    params = SamplingParams(
        n=2, best_of=5, temperature=1.0, seed=2, max_tokens=160, structured_outputs=constrained(json=PERSON)
    )
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(regex="[a-"), "structured_outputs.regex does not compile"),
        (dict(json='{"type": '), "structured_outputs.json does not compile"),
        (dict(json={"type": "objec"}), "structured_outputs.json does not compile"),
        (dict(grammar='root ::= "a" |'), "structured_outputs.grammar does not compile"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_and_nothing_is_queued(llm, spec, message):
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4, structured_outputs=constrained(**spec))
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().kv_blocks_used == 0


@pytest.mark.parametrize("fields", [dict(), dict(json=PERSON, regex="a")])
def test_structured_outputs_needs_exactly_one_constraint(fields):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(**fields)


def reference_prompt_logprobs(folder, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


def prompt_logprob_values(output) -> list[float]:
    assert output.prompt_logprobs[0] is None
    return [
        entry[token].logprob
        for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:], strict=True)
    ]


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_equal_transformers_with_and_without_a_prefix_cache_hit(tiny_llama, chunk):
    llm = LLM(model=tiny_llama, dtype="float32", block_size=4, max_num_batched_tokens=chunk or 2048)
    prompt = " ".join(PROMPTS)
    token_ids = llm.get_tokenizer().encode(prompt)
    expected = reference_prompt_logprobs(tiny_llama, token_ids)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)

    cold = llm.generate(prompt, params, use_tqdm=False)[0]
    hits_before = llm.stats().prefix_cache_hits
    warm = llm.generate(prompt, params, use_tqdm=False)[0]  # its blocks are in the cache now
    assert llm.stats().prefix_cache_hits == hits_before  # computed again, not read from the cache
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and llm.stats().prefix_cache_hits > hits_before

    for output in (cold, warm):
        assert len(output.prompt_logprobs) == len(token_ids)
        torch.testing.assert_close(torch.tensor(prompt_logprob_values(output)), expected, atol=1e-4, rtol=0)
        for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True):
            assert 3 <= len(entry) <= 4 and token in entry
            ranked = sorted((lp for t, lp in entry.items()), key=lambda lp: lp.rank)
            assert ranked[0].rank == 1 and all(lp.decoded_token is not None for lp in ranked)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_survive_preemption_and_forks(tiny_llama, mode):
    prompts = [p + " and more words to make it long" for p in PROMPTS]
    tokenizer = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64).get_tokenizer()
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    tight = LLM(
        model=tiny_llama,
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        preemption_mode=mode,
        swap_space=0.01,
        max_num_batched_tokens=16,
    )
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    check_kv_invariants(tight.engine.scheduler.kv)
    for prompt, output in zip(prompts, outputs, strict=True):
        token_ids = tokenizer.encode(prompt)
        expected = reference_prompt_logprobs(tiny_llama, token_ids)
        torch.testing.assert_close(torch.tensor(prompt_logprob_values(output)), expected, atol=1e-4, rtol=0)
        assert len(output.outputs) == 3


def test_logit_bias_pushes_a_token_and_is_range_checked(llm):
    token = llm.get_tokenizer().encode(" fox")[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={token: 100.0})
    (completion,) = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs
    assert completion.token_ids == [token] * 6
    with pytest.raises(ValueError, match="logit_bias values must be in"):
        SamplingParams(logit_bias={token: 101.0})
    with pytest.raises(ValueError, match="logit_bias token id 99999 is outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={99999: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 5}])
def test_json_strings_never_take_a_raw_control_character(llm, schema):
    # xgrammar's own rule for length-bounded strings lets them through; JSON forbids them.
    matcher = llm.engine.structured_outputs.matcher(constrained(json=schema))
    assert matcher.accept_string('"a')
    assert not matcher.fork().accept_string("\x1b")
    assert not matcher.fork().accept_string("\n")
    assert matcher.accept_string('b"') and matcher.is_completed()
