"""BERT-style encoders (BERT, XLM-RoBERTa, ModernBERT; RoBERTa's classifier) on the engine, against
sentence-transformers and transformers on the same tiny random weights (float32): embeddings with mean and CLS
pooling (cosine >= 0.99999), cross-encoder scores of text pairs with their token types (atol 1e-5) offline and over
HTTP, every prompt computed whole in one step with several per step, no prefix-cache hit, every block back after
every step; what `task="auto"` makes of them; and the prompts and options an encoder refuses, and why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams
from pagedllm.step import SchedulerOutput
from tests.encoder_models import MAX_POSITIONS, save_encoder, save_st_encoder
from tests.kv_invariants import check_kv_invariants
from tests.test_pooling import DOCUMENTS, EXACT, QUERY, SENTENCES
from tests.test_server import start_server, stop_server

FAMILIES = ["bert", "xlm-roberta", "modernbert"]
TEXTS = [*SENTENCES, "A block table maps logical blocks. Paged attention", "x", "Hi Hi Hi Hi Hi"]
BUDGET = MAX_POSITIONS  # the least an encoder's step may have: its longest prompt


def embed_stepped(llm: LLM, prompts: list, params: PoolingParams | None = None) -> tuple[torch.Tensor, list]:
    """The prompts' embeddings, stepping by hand: the KV invariants hold after every step, every block is back at
    the end, and each step's plan is returned."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, params or PoolingParams())
    vectors: dict[str, torch.Tensor] = {}
    plans: list[SchedulerOutput] = []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    try:
        while engine.has_unfinished_requests():
            vectors |= {out.request_id: out.outputs.data for out in engine.step() if out.finished}
            check_kv_invariants(scheduler.kv)
    finally:
        del scheduler.schedule
    assert scheduler.kv.pool.num_free == scheduler.kv.num_blocks, "an encoder's prompt left a block behind"
    assert not scheduler.kv.pool.cached, "an encoder's blocks hold nothing to find again"
    return torch.stack([vectors[f"e{i}"] for i in range(len(prompts))]), plans


def cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(got.float(), want.float(), dim=-1)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_equal_sentence_transformers_each_prompt_whole_in_one_step(family, pooling, tmp_path):
    folder = save_st_encoder(tmp_path / "m", family, pooling)
    prompts = TEXTS * 3
    want = SentenceTransformer(str(folder), device="cpu").encode(prompts, convert_to_tensor=True, batch_size=4)
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=BUDGET)
    assert llm.engine.task == "embed" and llm.engine.pooler.pooling_type == pooling
    got, plans = embed_stepped(llm, prompts)
    assert cosines(got, want).min() >= EXACT
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(prompts)), atol=1e-5)  # the Normalize module
    items = [item for plan in plans for item in plan.scheduled]
    assert all(item.num_new_tokens == item.seq.num_tokens for item in items), "each prompt whole, never chunked"
    assert len(plans) > 1 and max(len(plan.scheduled) for plan in plans) > 3, "several prompts a step, several steps"
    again = llm.embed(prompts[:2], use_tqdm=False)
    assert [output.num_cached_tokens for output in again] == [0, 0], "no prefix-cache hit: nothing was cached"


CLASSIFIERS = [
    ("bert", 1, {}),
    ("bert", 3, {}),
    ("xlm-roberta", 1, {}),
    ("xlm-roberta", 2, {}),
    ("roberta", 1, {}),
    ("modernbert", 1, {}),
    ("modernbert", 2, {"classifier_pooling": "mean"}),
]


@pytest.mark.parametrize(("family", "num_labels", "config"), CLASSIFIERS)
def test_a_cross_encoder_scores_pairs_as_transformers_does(family, num_labels, config, tmp_path):
    folder = save_encoder(tmp_path / "m", family, num_labels=num_labels, **config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    pairs = [tokenizer(QUERY, document, return_tensors="pt") for document in DOCUMENTS]
    if family == "bert":  # the pair's segments: the document's tokens are type 1
        assert all(pair["token_type_ids"].max() == 1 for pair in pairs)
    with torch.no_grad():
        logits = torch.stack([model(**pair).logits[0] for pair in pairs])
    want = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=BUDGET)
    assert llm.engine.task == "score"
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    got = torch.stack([output.outputs.data for output in outputs])
    assert torch.allclose(got, want, atol=1e-5)
    assert [output.prompt_token_ids for output in outputs] == [pair["input_ids"][0].tolist() for pair in pairs]
    if num_labels == 1:
        ranked = sorted(range(len(DOCUMENTS)), key=lambda i: -outputs[i].outputs.score)
        assert ranked == torch.argsort(want[:, 0], descending=True).tolist()
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free == kv.num_blocks


def test_auto_task_embeds_a_bare_encoder_by_its_normalized_cls_token_and_reads_prefixed_keys(tmp_path):
    """Without sentence-transformers' modules an encoder pools its CLS token, normalized (vLLM's default). A
    `BertModel` whose checkpoint keys carry the classifier's `bert.` prefix loads as transformers loads it."""
    folder = save_encoder(tmp_path / "classifier", "bert", num_labels=1)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"architectures": ["BertModel"]}))
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        want = [model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, 0] for text in TEXTS]
    llm = LLM(folder, dtype="float32")
    assert llm.engine.task == "embed" and llm.engine.pooler.pooling_type == "cls"
    got = torch.stack([output.outputs.data for output in llm.embed(TEXTS, use_tqdm=False)])
    assert cosines(got, torch.stack(want)).min() >= EXACT
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory) -> Path:
    return save_st_encoder(tmp_path_factory.mktemp("bert_mean") / "m", "bert", "mean")


def test_a_prompt_past_the_positions_is_refused_or_cut_by_the_tokenizer(bert_mean):
    llm = LLM(bert_mean, dtype="float32")
    assert llm.engine.max_model_len == MAX_POSITIONS
    long = " ".join(SENTENCES * 6)
    with pytest.raises(ValueError, match=f"tokens; max_model_len is {MAX_POSITIONS}"):
        llm.embed([long], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # Cut as sentence-transformers cuts it (to its max_seq_length): [CLS], the first tokens, [SEP].
    cut = llm.embed([long], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    want = SentenceTransformer(str(bert_mean), device="cpu").encode([long], convert_to_tensor=True)[0]
    assert len(cut.prompt_token_ids) == MAX_POSITIONS and cut.prompt_token_ids[0] == llm.engine.tokenizer.cls_token_id
    assert cosines(cut.outputs.data, want) >= EXACT
    short = llm.embed([long], PoolingParams(truncate_prompt_tokens=12), use_tqdm=False)[0]
    assert short.prompt_token_ids == llm.engine.tokenizer(long, truncation=True, max_length=12)["input_ids"]
    as_dict = llm.embed([{"prompt": long}], PoolingParams(truncate_prompt_tokens=12), use_tqdm=False)[0]
    assert as_dict.prompt_token_ids == short.prompt_token_ids


def test_modernbert_reads_the_hub_configs_layer_pattern(tmp_path):
    """Hub ModernBERT configs name `global_attn_every_n_layers` and the two RoPE thetas, not transformers 5's
    `layer_types` and `rope_parameters`: the same model either way."""
    folder = save_st_encoder(tmp_path / "m", "modernbert", "mean")
    want = torch.stack([o.outputs.data for o in LLM(folder, dtype="float32").embed(TEXTS, use_tqdm=False)])
    raw = json.loads((folder / "config.json").read_text())
    del raw["layer_types"], raw["rope_parameters"]
    raw |= {"global_rope_theta": 160000.0, "local_rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(raw))
    llm = LLM(folder, dtype="float32")
    assert llm.engine.loaded.config.sliding_windows == (0, 4, 0)
    assert cosines(torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)]), want).min() >= EXACT


def test_what_an_encoder_refuses_names_why(bert_mean, tmp_path):
    with pytest.raises(ValueError, match="max_num_batched_tokens 64 is smaller than max_model_len 256: BertModel"):
        LLM(bert_mean, max_num_batched_tokens=64)
    llm = LLM(bert_mean, dtype="float32", max_model_len=32, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == 32  # a budget that takes the longest prompt is enough
    with pytest.raises(ValueError, match="has no LM head to generate with; run it with task embed"):
        LLM(bert_mean, task="generate")
    with pytest.raises(ValueError, match="token_type_ids: 2 is outside"):
        llm.embed([{"prompt_token_ids": [2, 7, 3], "token_type_ids": [0, 2, 0]}], use_tqdm=False)
    with pytest.raises(ValueError, match="token_type_ids has 2 entries for 3 tokens"):
        llm.embed([{"prompt_token_ids": [2, 7, 3], "token_type_ids": [0, 1]}], use_tqdm=False)
    unsupported = tmp_path / "relative"
    shutil.copytree(bert_mean, unsupported)
    raw = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps(raw | {"position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not supported"):
        LLM(unsupported)


def test_a_served_cross_encoder_scores_and_reranks_as_offline(tmp_path):
    folder = save_encoder(tmp_path / "m", "bert", num_labels=1)
    offline = [output.outputs.score for output in LLM(folder, dtype="float32").score(QUERY, DOCUMENTS, False)]
    server = start_server(folder, tmp_path / "server.log")
    try:
        body = {"query": QUERY, "documents": DOCUMENTS}
        results = httpx.post(f"{server.url}/v1/rerank", json=body, timeout=60).json()["results"]
        body = {"text_1": QUERY, "text_2": DOCUMENTS}
        scored = httpx.post(f"{server.url}/v1/score", json=body, timeout=60).json()["data"]
    finally:
        assert stop_server(server) == 0, (tmp_path / "server.log").read_text()
    assert [result["index"] for result in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -offline[i])
    assert torch.allclose(torch.tensor([r["relevance_score"] for r in results]), torch.tensor(sorted(offline)[::-1]))
    assert torch.allclose(torch.tensor([item["score"] for item in scored]), torch.tensor(offline), atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_bfloat16_embeddings_are_as_close_to_float32_as_sentence_transformers_bfloat16(family, tmp_path):
    folder = save_st_encoder(tmp_path / "m", family, "mean")
    exact, _ = embed_stepped(LLM(folder, dtype="float32"), TEXTS)
    ours, _ = embed_stepped(LLM(folder, dtype="bfloat16"), TEXTS)
    peer = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.bfloat16})
    theirs = peer.encode(TEXTS, convert_to_tensor=True, batch_size=4)
    ours_cos, theirs_cos = cosines(ours, exact), cosines(theirs, exact)
    # Each rounds in its own order (ModernBERT's mean is 0.99987 both ways, its worst 0.99973 against 0.99977): as
    # close as theirs, to 1e-4.
    assert ours_cos.mean() >= theirs_cos.mean() - 1e-4 and ours_cos.min() >= theirs_cos.min() - 1e-4
