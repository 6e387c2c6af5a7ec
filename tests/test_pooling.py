"""Embeddings and scores on the engine, against sentence-transformers and transformers on the same weights (float32
cosine >= 0.99999): every family and pooling type through chunked prefill, prefix-cache hits, recompute and swap
preemption, with the KV invariants checked after every step; the classifier and yes/no heads; the requests an
engine refuses, and why."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.pacing import FIRST_BUDGET, PROBE_EVERY, PoolingPace
from pagedllm.pooling_params import PoolingParams
from pagedllm.step import SchedulerOutput
from tests.kv_invariants import check_kv_invariants
from tests.pooling_models import (
    EMBEDDING_FAMILIES,
    save_classifier,
    save_embedding_model,
    save_yes_no_reranker,
)

EXACT = 0.99999
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention",
    "A block table maps logical blocks to physical blocks in the pool. " * 4,
    "Hi",
    "Copy on write keeps shared blocks safe when sequences fork. Continuous batching admits new requests.",
    "Numbers like 12345 and symbols #@$ also appear. " * 2,
]


def texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def embed_checked(llm: LLM, prompts: list, params: PoolingParams | None = None) -> torch.Tensor:
    """The prompts' embeddings, stepping the engine by hand and checking the KV invariants after every step;
    every block is free at the end."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, params or PoolingParams())
    vectors: dict[str, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.finished
            vectors[output.request_id] = output.outputs.data
        check_kv_invariants(engine.scheduler.kv)
    kv = engine.scheduler.kv
    assert kv.pool.num_free == kv.num_blocks, "a pooling request left a block behind"
    return torch.stack([vectors[f"e{i}"] for i in range(len(prompts))])


def cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(got.float(), want.float(), dim=-1)


def reference(folder: Path, prompts: list[str], **encode) -> torch.Tensor:
    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(prompts, convert_to_tensor=True, batch_size=4, **encode)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("family", list(EMBEDDING_FAMILIES))
def test_embeddings_equal_sentence_transformers_through_chunked_prefill(family, pooling, tmp_path):
    folder = save_embedding_model(tmp_path / "model", family, pooling)
    prompts = texts(8, seed=len(family))
    want = reference(folder, prompts)
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=200, max_num_batched_tokens=24)
    assert llm.engine.task == "embed"
    got = embed_checked(llm, prompts)
    assert cosines(got, want).min() >= EXACT
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(prompts)), atol=1e-5)  # the Normalize module


@pytest.fixture(scope="module")
def last_model(tmp_path_factory) -> Path:
    return save_embedding_model(tmp_path_factory.mktemp("last") / "m", "qwen3", "last")


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory) -> Path:
    return save_embedding_model(tmp_path_factory.mktemp("mean") / "m", "qwen2", "mean", normalize=False)


def test_last_token_pooling_hits_the_prefix_cache_and_mean_pooling_only_fills_it(last_model, mean_model):
    prompt = SENTENCES[2]
    for folder, hits in ((last_model, True), (mean_model, False)):
        llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=100)
        first, second = llm.embed([prompt], use_tqdm=False), llm.embed([prompt], use_tqdm=False)
        assert first[0].num_cached_tokens == 0
        assert llm.engine.scheduler.kv.pool.cached, "the prompt's full blocks enter the prefix cache"
        assert (second[0].num_cached_tokens > 0) == hits
        assert cosines(second[0].outputs.data, first[0].outputs.data) >= EXACT
        assert cosines(first[0].outputs.data, reference(folder, [prompt])[0]) >= EXACT


@pytest.fixture(scope="module")
def chat_and_embed_model(tmp_path_factory) -> Path:
    """A causal LM with mean pooling: one engine generates with it and embeds with it."""
    return save_embedding_model(tmp_path_factory.mktemp("both") / "m", "qwen3", "mean", lm_head=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_generation_and_pooling_share_steps_and_survive_preemption(chat_and_embed_model, mode):
    """Decoders grow and preempt the pooling prompts being prefilled beside them (recompute starts a mean over,
    swap keeps it); the embeddings stay exact and the generations equal an engine that only generates."""
    folder = chat_and_embed_model
    prompts = texts(8, seed=3)
    chats = [[5 + i, 40, 77, 12 + i] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want_tokens = [
        out.outputs[0].token_ids for out in LLM(folder, task="generate", dtype="float32").generate(chats, greedy, False)
    ]
    options = dict(dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=32)
    llm = LLM(folder, task="generate,embed", preemption_mode=mode, swap_space=0.01, **options)
    engine = llm.engine
    for i, chat in enumerate(chats):
        engine.add_request(f"g{i}", chat, greedy)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, PoolingParams())
    done: dict = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
        check_kv_invariants(engine.scheduler.kv)
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.num_blocks
    stats = llm.stats()
    assert stats.num_preemptions > 0 and (mode == "recompute" or stats.num_swap_preemptions > 0)
    got = torch.stack([done[f"e{i}"].outputs.data for i in range(len(prompts))])
    assert cosines(got, reference(folder, prompts)).min() >= EXACT
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(len(chats))] == want_tokens


def test_dimensions_cut_then_normalize_on_a_matryoshka_model(tmp_path, last_model):
    folder = save_embedding_model(tmp_path / "m", "qwen3", "mean", is_matryoshka=True)
    prompts = texts(4)
    llm = LLM(folder, dtype="float32")
    got = embed_checked(llm, prompts, PoolingParams(dimensions=16))
    want = reference(folder, prompts, truncate_dim=16, normalize_embeddings=True)
    assert got.shape == (4, 16) and cosines(got, want).min() >= EXACT
    assert torch.allclose(got.norm(dim=-1), torch.ones(4), atol=1e-5)
    with pytest.raises(ValueError, match="dimensions 65 is not one this model gives: 1 to 64"):
        llm.engine.add_request("big", "a", PoolingParams(dimensions=65))
    plain = LLM(last_model, dtype="float32")
    with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
        plain.embed(["a"], PoolingParams(dimensions=8), use_tqdm=False)
    assert not plain.engine.has_unfinished_requests()


def test_instruction_prefixes_come_from_the_model_config(tmp_path):
    prompts_config = {"query": "Instruct: find the passage\nQuery: ", "document": ""}
    folder = save_embedding_model(
        tmp_path / "m", "mistral", "last", prompts=prompts_config, default_prompt_name="query"
    )
    prompts = texts(3)
    llm = LLM(folder, dtype="float32")
    default = torch.stack([o.outputs.data for o in llm.embed(prompts, use_tqdm=False)])
    document = torch.stack([o.outputs.data for o in llm.embed(prompts, use_tqdm=False, prompt_name="document")])
    assert cosines(default, reference(folder, prompts)).min() >= EXACT  # ST applies the default prompt too
    assert cosines(document, reference(folder, prompts, prompt_name="document")).min() >= EXACT
    assert cosines(default, document).max() < EXACT  # the prefix changes the vector
    with pytest.raises(ValueError, match="prompt_name 'passage' is not one of this model's prompts"):
        llm.embed(prompts, prompt_name="passage", use_tqdm=False)


QUERY = "Which block holds the key value cache?"
DOCUMENTS = SENTENCES


@pytest.mark.parametrize("num_labels", [1, 3])
def test_a_classifier_scores_as_transformers_does(tmp_path, num_labels):
    folder = save_classifier(tmp_path / "m", num_labels=num_labels)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    want = []
    with torch.no_grad():
        for document in DOCUMENTS:
            logits = model(**tokenizer(text=QUERY, text_pair=document, return_tensors="pt")).logits[0]
            want.append(torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1))
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.task == "score"
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    got = torch.stack([output.outputs.data for output in outputs])
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    if num_labels == 1:
        scores = [output.outputs.score for output in outputs]
        assert sorted(range(len(scores)), key=scores.__getitem__) == sorted(range(len(want)), key=want.__getitem__)
    else:
        with pytest.raises(ValueError, match="3 label probabilities"):
            _ = outputs[0].outputs.score


def test_a_yes_no_reranker_scores_the_sigmoid_of_yes_minus_no(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(save_yes_no_reranker(tmp_path / "probe", "a", "b"))
    no, yes = sorted(token for token in tokenizer.get_vocab() if token.isalpha() and len(token) > 3)[:2]
    folder = save_yes_no_reranker(tmp_path / "m", no, yes)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = [tokenizer.convert_tokens_to_ids(no), tokenizer.convert_tokens_to_ids(yes)]
    with torch.no_grad():
        logits = [model(**tokenizer(text=QUERY, text_pair=d, return_tensors="pt")).logits[0, -1] for d in DOCUMENTS]
    want = torch.tensor([torch.sigmoid(row[ids[1]] - row[ids[0]]) for row in logits])
    llm = LLM(folder, dtype="float32")
    assert llm.engine.task == "score"
    got = torch.tensor([output.outputs.score for output in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.argsort(got).tolist() == torch.argsort(want).tolist()


def test_an_embedding_model_scores_by_cosine_similarity(last_model):
    llm = LLM(last_model, dtype="float32")
    scores = [output.outputs.score for output in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    query = reference(last_model, [QUERY])[0]
    documents = reference(last_model, DOCUMENTS)
    assert torch.allclose(torch.tensor(scores), cosines(documents, query.expand_as(documents)), atol=1e-5)
    pairs = llm.score([QUERY, QUERY], DOCUMENTS[:2], use_tqdm=False)
    assert len(pairs) == 2
    with pytest.raises(ValueError, match="got 2 queries for 3 documents"):
        llm.score([QUERY, QUERY], DOCUMENTS[:3], use_tqdm=False)


def test_requests_an_engine_cannot_run_are_refused_naming_why(tiny_llama, last_model, tmp_path):
    generator = LLM(tiny_llama, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="task is generate: it gives no embeddings or scores"):
        generator.embed(["a"], use_tqdm=False)
    embedder = LLM(last_model, dtype="float32", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="task is embed: it gives embeddings, not generated text"):
        embedder.generate(["a"], use_tqdm=False)
    with pytest.raises(ValueError, match="has no LM head to generate with; run it with task embed"):
        LLM(last_model, task="generate")
    with pytest.raises(ValueError, match="prompt is empty"):
        embedder.embed([[]], use_tqdm=False)
    too_long = list(range(3, 3 + 70))
    with pytest.raises(ValueError, match="prompt has 70 tokens; max_model_len is 64"):
        embedder.embed([too_long], use_tqdm=False)
    assert not embedder.engine.has_unfinished_requests()
    # Truncation keeps the last tokens, as vLLM's truncate_prompt_tokens does.
    cut = embedder.embed([too_long], PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert cut.prompt_token_ids == too_long[-10:]
    whole = embedder.embed([too_long], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == too_long[-64:]
    assert cosines(cut.outputs.data, embedder.embed([too_long[-10:]], use_tqdm=False)[0].outputs.data) >= EXACT
    raw = json.loads((last_model / "config.json").read_text())
    unsupported = tmp_path / "dense"
    unsupported.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (unsupported / name).write_bytes((last_model / name).read_bytes())
    (unsupported / "config.json").write_text(json.dumps(raw))
    modules = json.loads((last_model / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (unsupported / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module sentence_transformers.models.Dense is not supported"):
        LLM(unsupported, dtype="float32")


def test_bfloat16_embeddings_are_no_further_from_float32_than_transformers_bfloat16(mean_model):
    prompts = texts(12, seed=5)
    exact = embed_checked(LLM(mean_model, dtype="float32"), prompts)
    ours = embed_checked(LLM(mean_model, dtype="bfloat16"), prompts)
    peer = SentenceTransformer(str(mean_model), device="cpu", model_kwargs={"dtype": torch.bfloat16})
    theirs = peer.encode(prompts, convert_to_tensor=True, batch_size=4)
    ours_cos, theirs_cos = cosines(ours, exact), cosines(theirs, exact)
    assert ours_cos.mean() >= theirs_cos.mean() and ours_cos.min() >= theirs_cos.min()


def test_pooling_yields_to_generation_within_its_paced_budget(chat_and_embed_model, monkeypatch):
    """While a stream runs, pooled tokens per step stay within the scheduler's pooling budget (the engine's pace)
    and a generation request queued behind a flood is admitted first; alone, pooling takes the whole budget."""
    llm = LLM(chat_and_embed_model, task="generate,embed", dtype="float32", max_num_batched_tokens=64)
    engine, scheduler = llm.engine, llm.engine.scheduler
    plans: list[tuple[int | None, SchedulerOutput]] = []
    schedule = scheduler.schedule
    monkeypatch.setattr(
        scheduler, "schedule", lambda: plans.append((scheduler.pooling_budget, schedule())) or plans[-1][1]
    )
    for i, prompt in enumerate(texts(6, seed=9)):
        engine.add_request(f"e{i}", prompt, PoolingParams())
    engine.step()
    assert sum(item.num_new_tokens for item in plans[0][1].scheduled) == 64
    assert scheduler.waiting_pooled, "pooling prompts still wait when the chat comes"
    engine.add_request("chat", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    plans.clear()
    while engine.has_unfinished_requests():
        engine.step()
        check_kv_invariants(scheduler.kv)
    with_chat = [(budget, plan) for budget, plan in plans if any(item.seq.pool is None for item in plan.scheduled)]
    pooled = [sum(item.num_new_tokens for item in plan.scheduled if item.seq.pool) for _, plan in with_chat]
    assert len(with_chat) == 30 and all(n <= budget for n, (budget, _) in zip(pooled, with_chat, strict=True))
    assert with_chat[0][1] is plans[0][1], "the chat runs in the first step after it came, before the pooling queue"
    assert scheduler.stats(0, {}).num_pooled_requests == 6


def test_the_pace_lets_pooled_tokens_stretch_a_step_by_the_share_asked():
    pace = PoolingPace(stretch=0.5)
    assert pace.budget() == 0  # the first step with generation measures it alone
    pace.record(1 / 64, 0)  # a step of generation alone: 1/64 s (binary fractions: exact sums)
    assert pace.budget() == FIRST_BUDGET
    budgets = []
    for _ in range(5 * PROBE_EVERY):
        budget = pace.budget()
        budgets.append(budget)
        pace.record(1 / 64 + budget / 1024, budget)  # each pooled token adds 1/1024 s
    assert budgets[-1] == 8  # 0.5 x 1/64 / (1/1024)
    assert budgets.count(0) == 4  # under a flood, one step in PROBE_EVERY measures the step without it
    for _ in range(50):
        pace.record(1 / 64 + 0.1, 1)  # pooled tokens got dear: at least one a step still runs
    assert pace.budget() in (0, 1)
