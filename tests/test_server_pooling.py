"""`/v1/embeddings`, `/v1/score` and `/v1/rerank` over real HTTP, against `pagedllm serve` subprocesses: an embed
server (a tiny mean-pooled Matryoshka model with an instruction prefix) and a score server (a tiny cross-encoder),
driven by the official `openai` client, LangChain's `OpenAIEmbeddings` and plain httpx. Every answer is held to the
offline `LLM` on the same checkpoint. The embed server's model has an LM head and runs `--task generate,embed`, so
completions share its steps; the refusals of a task neither server runs are the app's own, over a stand-in engine."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from langchain_openai import OpenAIEmbeddings

from pagedllm import LLM, SamplingParams
from pagedllm.config import ServeOptions
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.field_policy import IGNORED_HEADER
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.pooling_params import PoolingParams
from tests.pooling_models import save_classifier, save_embedding_model
from tests.test_server import NUM_KV_BLOCKS, ServerProcess, start_server, stop_server

EMB, SCORER, GEN = "emb", "scorer", "gen"
BOTH = "generate,embed"  # the embed server's task
MAX_PROMPTS, MAX_DOCUMENTS = 64, 4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention stores blocks.", "Hello world!"]
QUERY = "Which animal jumps?"
DOCUMENTS = ["Copy on write keeps shared blocks safe.", "The quick brown fox jumps.", "Numbers like 12345 appear."]
TOKEN_INPUTS = [[5, 6, 7, 8], [40, 41, 42]]
LONG = "hello " * 600  # past the tiny models' 512 positions
PROMPTS = {"query": "query: ", "passage": "passage: "}


def cosine(a: list[float] | np.ndarray, b: list[float] | np.ndarray) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


def assert_same_vectors(served: list, expected: list) -> None:
    assert len(served) == len(expected)
    for got, want in zip(served, expected, strict=True):
        assert len(got) == len(want)
        assert cosine(got, want) >= 0.99999


def post(server: ServerProcess, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, **{"timeout": 60.0} | kwargs)


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def offline(model: Path, task: str = "auto") -> LLM:
    return LLM(model=model, dtype="float32", num_kv_blocks=int(NUM_KV_BLOCKS), task=task)


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("embed") / "model"
    # The default prompt shows that the server prefixes texts as LLM.embed does: without it the vectors differ. With
    # its LM head the model also generates, beside its embeddings, in the same engine.
    return save_embedding_model(
        folder, "qwen3", "mean", prompts=PROMPTS, default_prompt_name="passage", lm_head=True, is_matryoshka=True
    )


@pytest.fixture(scope="module")
def score_model(tmp_path_factory) -> Path:
    return save_classifier(tmp_path_factory.mktemp("scorer") / "model")


def _serve(model: Path, name: str, *flags: str) -> Iterator[ServerProcess]:
    log = model.parent / "server.log"
    process = start_server(model, log, "--served-model-name", name, *flags)
    yield process
    assert stop_server(process) == 0, log.read_text()


@pytest.fixture(scope="module")
def embed_server(embed_model) -> Iterator[ServerProcess]:
    limits = ["--max-prompts", str(MAX_PROMPTS), "--max-score-documents", str(MAX_DOCUMENTS)]
    yield from _serve(embed_model, EMB, "--task", BOTH, *limits)


@pytest.fixture(scope="module")
def score_server(score_model) -> Iterator[ServerProcess]:
    yield from _serve(score_model, SCORER)


@pytest.fixture(scope="module")
def embed_llm(embed_model) -> LLM:
    return offline(embed_model, BOTH)


@pytest.fixture(scope="module")
def score_llm(score_model) -> LLM:
    return offline(score_model)


@pytest.fixture(scope="module")
def client(embed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def embeddings(llm: LLM, prompts: list, params: PoolingParams | None = None) -> list[list[float]]:
    return [output.outputs.embedding for output in llm.embed(prompts, params, use_tqdm=False)]


def scores(llm: LLM, query: str | list[str], documents: list[str]) -> list[float]:
    return [output.outputs.score for output in llm.score(query, documents, use_tqdm=False)]


# ---- embeddings -----------------------------------------------------------------------------------------


def test_the_openai_client_gets_the_offline_embeddings(client, embed_llm):
    """The SDK's default call asks for base64 and decodes it: the float32 bytes must be the vectors."""
    result = client.embeddings.create(model=EMB, input=TEXTS)
    assert [item.index for item in result.data] == [0, 1, 2]
    assert_same_vectors([item.embedding for item in result.data], embeddings(embed_llm, TEXTS))
    expected_tokens = sum(len(output.prompt_token_ids) for output in embed_llm.embed(TEXTS, use_tqdm=False))
    assert result.usage.prompt_tokens == result.usage.total_tokens == expected_tokens
    assert result.model == EMB and result.object == "list"


def test_base64_is_the_float_vectors_bytes(embed_server):
    floats = post(embed_server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float"}).json()
    encoded = post(embed_server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    raw = encoded["data"][0]["embedding"]
    assert isinstance(raw, str) and isinstance(floats["data"][0]["embedding"], list)
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


def test_token_id_inputs_as_floats(client, embed_llm):
    result = client.embeddings.create(model=EMB, input=TOKEN_INPUTS, encoding_format="float")
    assert_same_vectors([item.embedding for item in result.data], embeddings(embed_llm, TOKEN_INPUTS))
    assert result.usage.prompt_tokens == sum(map(len, TOKEN_INPUTS))
    (one,) = client.embeddings.create(model=EMB, input=TOKEN_INPUTS[0], encoding_format="float").data
    assert_same_vectors([one.embedding], embeddings(embed_llm, [TOKEN_INPUTS[0]]))


def test_dimensions_shorten_a_matryoshka_model(client, embed_llm):
    result = client.embeddings.create(model=EMB, input=TEXTS, dimensions=8)
    vectors = [item.embedding for item in result.data]
    assert {len(vector) for vector in vectors} == {8}
    assert all(np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5) for vector in vectors)
    assert_same_vectors(vectors, embeddings(embed_llm, TEXTS, PoolingParams(dimensions=8)))


def test_normalize_false_and_truncation_match_offline(embed_server, embed_llm):
    body = {"input": TEXTS, "normalize": False, "encoding_format": "float"}
    raw = [item["embedding"] for item in post(embed_server, "/v1/embeddings", body).json()["data"]]
    expected = embeddings(embed_llm, TEXTS, PoolingParams(normalize=False))
    assert_same_vectors(raw, expected)
    assert np.linalg.norm(raw[0]) == pytest.approx(np.linalg.norm(expected[0]), rel=1e-4)
    assert np.linalg.norm(raw[0]) != pytest.approx(1.0, abs=1e-3)
    cut = post(embed_server, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": 16}).json()
    assert cut["usage"]["prompt_tokens"] == 16
    assert_same_vectors(
        [cut["data"][0]["embedding"]], embeddings(embed_llm, [LONG], PoolingParams(truncate_prompt_tokens=16))
    )
    whole = post(embed_server, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == embed_llm.engine.max_model_len


def test_langchain_embeds_documents_and_queries(embed_server, embed_llm):
    """LangChain's documented setup for an OpenAI-compatible server (check_embedding_ctx_length=False: the default
    tokenizes with tiktoken, which downloads)."""
    model = OpenAIEmbeddings(
        model=EMB, base_url=f"{embed_server.url}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    expected = embeddings(embed_llm, TEXTS)
    assert_same_vectors(model.embed_documents(TEXTS), expected)
    assert_same_vectors([model.embed_query(TEXTS[1])], [expected[1]])


def test_user_is_accepted_and_named_ignored(client):
    response = client.embeddings.with_raw_response.create(model=EMB, input="hi", user="someone")
    assert response.headers[IGNORED_HEADER] == "user"
    assert len(response.parse().data) == 1


# ---- scores and reranking -------------------------------------------------------------------------------


def test_an_embed_server_scores_by_cosine_similarity(embed_server, embed_llm):
    expected = scores(embed_llm, QUERY, DOCUMENTS)
    for body in ({"text_1": QUERY, "text_2": DOCUMENTS}, {"queries": QUERY, "documents": DOCUMENTS}):
        result = post(embed_server, "/v1/score", body).json()
        assert [item["index"] for item in result["data"]] == [0, 1, 2]
        assert [item["object"] for item in result["data"]] == ["score"] * 3
        assert [item["score"] for item in result["data"]] == pytest.approx(expected, abs=1e-5)
        assert result["object"] == "list" and result["model"] == EMB
    pairwise = post(embed_server, "/v1/score", {"text_1": DOCUMENTS[::-1], "text_2": DOCUMENTS}).json()
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(
        scores(embed_llm, DOCUMENTS[::-1], DOCUMENTS), abs=1e-5
    )


def test_an_embed_server_reranks_by_its_scores(embed_server, embed_llm):
    expected = scores(embed_llm, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda index: -expected[index])
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        result = post(embed_server, path, {"model": EMB, "query": QUERY, "documents": documents}).json()
        assert [item["index"] for item in result["results"]] == order
        assert [item["relevance_score"] for item in result["results"]] == pytest.approx(
            [expected[index] for index in order], abs=1e-5
        )
        assert [item["document"]["text"] for item in result["results"]] == [DOCUMENTS[index] for index in order]
        assert result["usage"]["total_tokens"] > 0 and result["model"] == EMB
    top = post(
        embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1, "return_documents": False}
    )
    assert [(item["index"], item["document"]) for item in top.json()["results"]] == [(order[0], None)]


def test_a_score_server_runs_the_cross_encoder(score_server, score_llm):
    expected = scores(score_llm, QUERY, DOCUMENTS)
    assert len(set(expected)) == 3  # distinct, so that the order below means something
    result = post(score_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [item["score"] for item in result["data"]] == pytest.approx(expected, abs=1e-5)
    expected_tokens = sum(len(output.prompt_token_ids) for output in score_llm.score(QUERY, DOCUMENTS, use_tqdm=False))
    assert result["usage"]["prompt_tokens"] == expected_tokens
    ranked = post(score_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    assert [item["index"] for item in ranked] == sorted(range(3), key=lambda index: -expected[index])
    assert [item["relevance_score"] for item in ranked] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)


# ---- each route on the server of its task -----------------------------------------------------------------


@dataclass
class StandInEngine:
    """What the app reads of its engine before a request reaches the engine: the refusals of a task the two servers
    here do not run, without a server that would load a model only to refuse."""

    task: str
    pooler: None = None
    max_model_len: int = 512
    overloaded: bool = False
    metrics: ServerMetrics = field(default_factory=ServerMetrics)


def stand_in(task: str) -> TestClient:
    # No chat is rendered: each request is refused by its route first.
    return TestClient(build_app(StandInEngine(task), render_chat=None, options=ServeOptions(served_model_names=(GEN,))))


def test_models_say_the_task(embed_server, score_server):
    for server, name, task in ((embed_server, EMB, "generate,embed"), (score_server, SCORER, "score")):
        (card,) = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert (card["id"], card["task"]) == (name, task)
    (card,) = stand_in("generate").get("/v1/models").json()["data"]
    assert (card["id"], card["task"]) == (GEN, "generate")


GENERATING = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 2}),
]
POOLING = [
    ("/v1/embeddings", {"input": "Hello"}),
    ("/v1/score", {"text_1": "Hello", "text_2": "world"}),
    ("/v1/rerank", {"query": "Hello", "documents": ["world"]}),
]


@pytest.mark.parametrize(("path", "body"), GENERATING, ids=[path for path, _ in GENERATING])
def test_generating_on_a_score_or_embed_server_is_a_400_naming_the_task(score_server, path, body):
    error = refusal(post(score_server, path, body))
    assert "task is score" in error["message"] and "--task generate" in error["message"]
    assert error["param"] == "model" and error["code"] == "wrong_task"
    error = refusal(stand_in("embed").post(path, json=body))
    assert "task is embed" in error["message"] and "--task generate" in error["message"]


@pytest.mark.parametrize(("path", "body"), POOLING, ids=[path for path, _ in POOLING])
def test_pooling_on_a_generate_server_is_a_400_naming_the_task(path, body):
    error = refusal(stand_in("generate").post(path, json=body))
    assert "task is generate" in error["message"] and error["param"] == "model"


def test_embeddings_on_a_score_server_are_a_400_naming_the_task(score_server):
    error = refusal(post(score_server, "/v1/embeddings", {"input": "Hello"}))
    assert "task is score" in error["message"] and "--task embed" in error["message"]
    # An engine that generates and scores gives no embeddings either.
    error = refusal(stand_in("generate,score").post("/v1/embeddings", json={"input": "Hello"}))
    assert "task is generate,score" in error["message"] and "it scores pairs" in error["message"]


def test_a_generate_embed_server_generates_beside_the_embeddings(embed_server, client, embed_llm):
    """Completions and embeddings in the same engine steps: each gets its own kind of output, and only the completion
    counts a first token."""
    (expected,) = embed_llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    ttft = "pagedllm:time_to_first_token_seconds_count"
    before = embed_server.metric(ttft)
    with ThreadPoolExecutor(2) as pool:
        completion = pool.submit(
            client.completions.create, model=EMB, prompt="Hello world", max_tokens=16, temperature=0
        )
        embedded = pool.submit(client.embeddings.create, model=EMB, input=TEXTS)
        assert completion.result().choices[0].text == expected.outputs[0].text
        assert_same_vectors([item.embedding for item in embedded.result().data], embeddings(embed_llm, TEXTS))
    assert embed_server.metric(ttft) - before == 1


# ---- bad input --------------------------------------------------------------------------------------------

VOCAB_OUTSIDE = 10**6
BAD = [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["fine", ""]}, "input.1"),
    ("/v1/embeddings", {"input": [[5, 6], []]}, "input.1"),
    ("/v1/embeddings", {"input": ["fine", LONG]}, "input.1"),
    ("/v1/embeddings", {"input": [[5, 6], [5, VOCAB_OUTSIDE]]}, "input.1"),
    ("/v1/embeddings", {"input": [VOCAB_OUTSIDE]}, "input"),
    ("/v1/embeddings", {"input": ["a"] * (MAX_PROMPTS + 1)}, "input"),
    ("/v1/embeddings", {"input": "fine", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "fine", "encoding_format": "binary"}, "encoding_format"),
    ("/v1/embeddings", {"input": "fine", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": [1.5]}, "input"),
    ("/v1/score", {"text_1": "q", "text_2": ["a"] * (MAX_DOCUMENTS + 1)}, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"queries": "q", "documents": []}, "documents"),
    ("/v1/score", {"text_1": "", "text_2": ["a"]}, "text_1"),
    ("/v1/score", {"text_1": "q", "text_2": ["a", LONG]}, "text_2.1"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents.1"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD, ids=[f"{path}-{param}-{i}" for i, (path, _, param) in enumerate(BAD)]
)
def test_bad_input_is_a_400_naming_the_field(embed_server, path, body, param):
    error = refusal(post(embed_server, path, body))
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".", 1)[0] in error["message"]


def test_mixed_score_namings_are_a_400(embed_server):
    error = refusal(post(embed_server, "/v1/score", {"text_1": "q", "documents": ["a"]}))
    assert "text_1 and text_2, or queries and documents" in error["message"]


def test_a_long_pair_on_the_score_server_names_its_document(score_server):
    error = refusal(post(score_server, "/v1/rerank", {"query": "q", "documents": ["fine", LONG]}))
    assert error["param"] == "documents.1" and "max_model_len" in error["message"]


def test_after_bad_input_the_server_serves_and_every_block_is_back(embed_server, client, embed_llm):
    for path, body, _ in BAD:
        post(embed_server, path, body)
    result = client.embeddings.create(model=EMB, input=TEXTS)
    assert_same_vectors([item.embedding for item in result.data], embeddings(embed_llm, TEXTS))
    assert embed_server.wait_for("pagedllm:kv_blocks_used", lambda used: used == 0) == 0


# ---- metrics and aborts -----------------------------------------------------------------------------------


def test_metrics_count_pooling_requests_and_their_prompt_tokens(embed_server):
    before = embed_server.metrics()
    result = post(embed_server, "/v1/embeddings", {"input": TOKEN_INPUTS}).json()
    after = embed_server.metrics()
    assert after["pagedllm:pooling_requests_total"] - before["pagedllm:pooling_requests_total"] == 2
    tokens = after["pagedllm:pooling_prompt_tokens_total"] - before["pagedllm:pooling_prompt_tokens_total"]
    assert tokens == result["usage"]["prompt_tokens"] == sum(map(len, TOKEN_INPUTS))
    # Pooling requests finish (stop) without a first token: no TTFT is observed for them.
    assert after["pagedllm:time_to_first_token_seconds_count"] == before.get(
        "pagedllm:time_to_first_token_seconds_count", 0.0
    )
    finished = 'pagedllm:requests_finished_total{finish_reason="stop"}'
    assert after[finished] - before.get(finished, 0.0) == 2


def test_a_client_that_leaves_aborts_every_input_and_the_blocks_come_back(embed_server):
    """The client hangs up once its first input is pooled, with most of the MAX_PROMPTS inputs of 500 tokens still
    to run (a fixed client timeout raced the work: a fast machine pooled them all before it fired)."""
    aborted, stopped = (f'pagedllm:requests_finished_total{{finish_reason="{why}"}}' for why in ("abort", "stop"))
    pooled = "pagedllm:pooling_requests_total"
    before = embed_server.metrics()
    body = json.dumps({"input": [[10 + index] * 500 for index in range(MAX_PROMPTS)]}).encode()
    url = httpx.URL(embed_server.url)
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        embed_server.wait_for(pooled, lambda count: count > before[pooled])
    # The disconnect ends every input not finished yet at once.
    embed_server.wait_for(aborted, lambda count: count > before.get(aborted, 0.0))
    assert embed_server.wait_for("pagedllm:kv_blocks_used", lambda used: used == 0) == 0
    embed_server.wait_for("pagedllm:num_requests_running", lambda running: running == 0)
    after = embed_server.metrics()
    ended = sum(after[name] - before.get(name, 0.0) for name in (aborted, stopped))
    assert ended == MAX_PROMPTS
    assert after[pooled] - before[pooled] < MAX_PROMPTS
