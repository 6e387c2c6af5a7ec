"""`pagedllm bench embed`: the fixed corpus, and the command end to end on a tiny embedding model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.benchmarks.embed import embedder_folder, make_corpus
from pagedllm.cli import main
from pagedllm.entrypoints.llm import LLM
from tests.conftest import save_tiny_llama
from tests.pooling_models import save_embedding_model


@pytest.fixture(scope="module")
def tiny_embedder(tmp_path_factory) -> Path:
    # Room for the corpus's longest windows in the tiny tokenizer's tokens (up to about 700).
    folder = tmp_path_factory.mktemp("tiny_embedder")
    return save_embedding_model(folder, "qwen3", "last", max_position_embeddings=1024)


def test_the_corpus_is_fixed_and_its_prefix_is_the_smaller_corpus():
    corpus = make_corpus(300)
    assert corpus == make_corpus(300)
    assert make_corpus(20) == corpus[:20]
    lengths = [len(sentence.split()) for sentence in corpus]
    assert min(lengths) >= 4 and max(lengths) <= 150
    assert min(lengths) < 10 and max(lengths) > 100  # short and long ones, not one length


def test_command_writes_both_engines_figures_that_agree_and_a_plot(tiny_embedder, tmp_path, capsys):
    output, plot = tmp_path / "embed.json", tmp_path / "embed.png"
    args = ["bench", "embed", "--model", str(tiny_embedder), "--num-sentences", "24", "--batch-sizes", "1,8"]
    # One thread: beside a neighbour on a shared machine two-thread operators stall, and this checks the figures
    # are there and agree, not how fast they are.
    args += ["--warmup", "4", "--threads", "1", "--output", str(output), "--plot", str(plot)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "pagedllm/ST" in table and "forward" in table
    report = json.loads(output.read_text())
    assert report["dtype"] == "torch.float32" and report["num_sentences"] == 24
    assert [result["batch_size"] for result in report["results"]] == [1, 8]
    for result in report["results"]:
        assert result["sentences"] == 24 and result["tokens"] > 24
        for engine in ("pagedllm", "sentence_transformers"):
            assert result[engine]["sentences_per_s"] > 0 and result[engine]["tokens_per_s"] > 0
        assert result["ratio"] == pytest.approx(
            result["pagedllm"]["sentences_per_s"] / result["sentence_transformers"]["sentences_per_s"]
        )
        assert result["cosine_worst"] >= 0.99999 and result["cosine_mean"] >= result["cosine_worst"]
        assert result["pagedllm_phases"]["forward"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_causal_lm_folder_is_embedded_by_its_last_token_normalized(tmp_path):
    causal = save_tiny_llama(tmp_path / "causal")
    with embedder_folder(causal) as folder:
        pooler = LLM(folder, dtype="float32", num_kv_blocks=16).engine.pooler
        assert pooler is not None and (pooler.task, pooler.pooling_type, pooler.normalize) == ("embed", "last", True)
    assert not folder.exists()  # the links were temporary, the model's own folder is untouched
    assert not (causal / "modules.json").exists()
