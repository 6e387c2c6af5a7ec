"""GGUF round trips, one per architecture: a tiny random transformers model, written as a GGUF the way
llama.cpp's `convert_hf_to_gguf.py` writes it, converted back and compared with the original folder."""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from pagedllm import LLM, SamplingParams
from pagedllm.models.gguf import (
    SUPPORTED_GGUF_ARCHITECTURES,
    gguf_to_hf_folder,
    llama3_rope_factors,
    llama3_rope_scaling,
)
from pagedllm.models.loader import load_tokenizer
from tests.conftest import build_tokenizer

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # Wide random weights give confident logits, so greedy choices are rarely near-ties.
    initializer_range=0.3,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TEXTS = ["Hello world!", "The quick brown fox", "<|im_start|>user\nHi<|im_end|>\n", "  spaces\tand\nlines 12345"]


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    model_type: str
    settings: dict = field(default_factory=dict)
    name: str = "Tiny"  # general.name
    f16: bool = False  # matrices written as F16, the way llama.cpp's default --outtype does
    # Matrices written quantized, as `llama-quantize` writes them: the type of the first key found in the
    # tensor's GGUF name ("" matches every matrix), as a Q4_K_M file mixes types.
    quant: dict[str, gguf.GGMLQuantizationType] = field(default_factory=dict)


FAMILIES = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, "llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    # llama.cpp writes MistralForCausalLM as a `llama` file; the model's name says what it was.
    "mistral": Family(
        gguf.MODEL_ARCH.LLAMA, "mistral", dict(sliding_window=None, tie_word_embeddings=True), name="Tiny Mistral"
    ),
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2, "qwen2", dict(tie_word_embeddings=True, rope_theta=1e6), f16=True),
    "qwen3": Family(gguf.MODEL_ARCH.QWEN3, "qwen3", dict(head_dim=32, rope_theta=1e6)),
    "gemma2": Family(
        gguf.MODEL_ARCH.GEMMA2,
        "gemma2",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=64, attn_logit_softcapping=50.0),
    ),
    "gemma3": Family(
        gguf.MODEL_ARCH.GEMMA3,
        "gemma3_text",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=64,
            rope_theta=1e6,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),
    "phi3": Family(
        gguf.MODEL_ARCH.PHI3,
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            rope_scaling={"rope_type": "longrope", "long_factor": [1.0, 2.5, 6.0, 9.0], "short_factor": [1.0] * 4},
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": Family(
        gguf.MODEL_ARCH.QWEN3MOE,
        "qwen3_moe",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
}
# Refused (pagedllm has no shared expert): written only to see it refused.
QWEN2_MOE = Family(
    gguf.MODEL_ARCH.QWEN2MOE,
    "qwen2_moe",
    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
)


def save_tiny_family(folder: Path, family: Family, seed: int = 0) -> Path:
    tokenizer = build_tokenizer()
    settings = dict(
        COMMON,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(family.settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family.model_type, **settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                # Random norms (Gemma's start at zero) on a 1/256 grid, so llama.cpp's `w + 1` is exact.
                param.copy_(torch.randint(-64, 64, param.shape) / 256)
            elif family.f16:
                param.copy_(param.half().float())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    GenerationConfig.from_model_config(model.config).save_pretrained(folder)
    return folder


def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """`LlamaModel.permute` in llama.cpp's converter: HF's rotate-half rows to interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama_cpp_rope_freqs(config) -> np.ndarray:
    """`LlamaModel.generate_extra_tensors`: llama3 rope scaling as per-frequency divisors."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


# gguf-py quantizes no K-quant: their matrices are random blocks instead, with sane fp16 scales at these byte
# offsets of a block. gguf dequantizes them, so the folder converted back from the file holds their values (the
# reference of the tests that use one), not the original folder's.
K_SCALES = {
    gguf.GGMLQuantizationType.Q4_K: (0, 2),
    gguf.GGMLQuantizationType.Q5_K: (0, 2),
    gguf.GGMLQuantizationType.Q6_K: (208,),
}


def quantize_blocks(values: np.ndarray, kind: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`values` (float32, [rows, width]) as `kind`'s blocks: gguf's quantization, or random K-quant blocks."""
    if kind not in K_SCALES:
        return gguf.quants.quantize(values, kind)
    rows, width = values.shape
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, width // block, size), dtype=np.uint8)
    for at in K_SCALES[kind]:
        data[..., at : at + 2] = rng.uniform(0.001, 0.01, data.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def write_gguf(folder: Path, path: Path, family: Family) -> None:
    """What llama.cpp's `convert_hf_to_gguf.py` writes for this folder (float32, or F16 matrices)."""
    config = AutoConfig.from_pretrained(folder)
    arch = family.arch
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(family.name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(
        config.rope_parameters.get("rope_theta") or config.rope_parameters["full_attention"]["rope_theta"]
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if family.f16 else gguf.LlamaFileType.ALL_F32)
    if "head_dim" in family.settings:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    extra: dict[str, np.ndarray] = {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
        if config.rope_parameters.get("rope_type") == "llama3":
            extra[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = llama_cpp_rope_freqs(config)
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        writer.add_sliding_window(config.sliding_window)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == gguf.MODEL_ARCH.GEMMA3:
        scaling = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(scaling["rope_theta"])
        if scaling.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
    if arch == gguf.MODEL_ARCH.PHI3:
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings))
        )
        extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)

    add_tokenizer(writer, folder)
    for name, array in [*gguf_tensors(folder, config, family), *extra.items()]:
        kind = next((kind for part, kind in family.quant.items() if part in name), None)
        if kind is not None and array.ndim == 2 and ".exps." not in name:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            writer.add_tensor(name, quantize_blocks(array.astype(np.float32), kind, rng), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_tensors(folder: Path, config, family: Family):
    """The checkpoint's tensors under gguf's names, with llama.cpp's value transforms."""
    name_map = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    tensors = load_file(folder / "model.safetensors")
    # llama.cpp stacks each layer's experts into one tensor per projection.
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in sorted(tensors):
        parts = name.split(".")
        if ".mlp.experts." in name and parts[5].isdigit():
            stacked = ".".join(parts[:5] + parts[6:])
            experts.setdefault(stacked, {})[int(parts[5])] = tensors.pop(name)
    for stacked, by_expert in experts.items():
        tensors[stacked] = torch.stack([by_expert[i] for i in sorted(by_expert)])

    for name, tensor in tensors.items():
        if family.arch == gguf.MODEL_ARCH.LLAMA and name.endswith("q_proj.weight"):
            tensor = llama_cpp_permute(tensor, config.num_attention_heads, config.num_attention_heads)
        if family.arch == gguf.MODEL_ARCH.LLAMA and name.endswith("k_proj.weight"):
            tensor = llama_cpp_permute(tensor, config.num_attention_heads, config.num_key_value_heads)
        if family.arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and name.endswith("norm.weight"):
            tensor = tensor + 1
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = tensor.squeeze().numpy()  # llama.cpp drops size-1 dimensions
        if family.f16 and array.ndim > 1:
            array = array.astype(np.float16)
        yield gguf_name, array


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    """`_set_vocab_gpt2` in llama.cpp's converter: a byte-level BPE vocabulary, its merges and special ids."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    tokens = [by_id[i] for i in range(len(by_id))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)
    writer.add_add_bos_token(False)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def round_trip(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    family = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    original = save_tiny_family(root / "hf", family)
    path = root / f"tiny-{request.param}.gguf"
    write_gguf(original, path, family)
    return request.param, original, path, gguf_to_hf_folder(path, cache_dir=root / "cache")


def test_weights_equal_the_original_checkpoint(round_trip) -> None:
    _, original, _, converted = round_trip
    expected = load_file(original / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name


# Fields a GGUF file does not carry (training-time settings), and what differs only in how it is written.
NOT_IN_GGUF = {"initializer_range", "transformers_version", "dtype", "_name_or_path", "use_cache"}


def test_config_matches_the_original(round_trip) -> None:
    name, original, _, converted = round_trip
    expected = AutoConfig.from_pretrained(original).to_dict()
    ours = AutoConfig.from_pretrained(converted).to_dict()
    assert ours["architectures"] == expected["architectures"] and ours["model_type"] == expected["model_type"]
    for key in sorted((set(expected) | set(ours)) - NOT_IN_GGUF):
        assert same(ours.get(key), expected.get(key)), (name, key, ours.get(key), expected.get(key))
    assert AutoConfig.from_pretrained(converted).dtype == torch.float32


def same(a, b) -> bool:
    """Equal, floats compared as the float32 GGUF stores them."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.float32(a) == np.float32(b)
    return a == b


def test_tokenizer_and_generation_config_match(round_trip) -> None:
    _, original, _, converted = round_trip
    # The engine's reading of a conversion (its own tokenizer class) against the original checkpoint's AutoTokenizer.
    ours, expected = load_tokenizer(converted), AutoTokenizer.from_pretrained(original)
    for text in TEXTS:
        assert ours(text).input_ids == expected(text).input_ids, text
    assert ours.chat_template == expected.chat_template
    generation = GenerationConfig.from_pretrained(converted)
    assert generation.eos_token_id == expected.eos_token_id == 2
    assert (generation.bos_token_id, generation.pad_token_id) == (expected.bos_token_id, expected.pad_token_id)


def test_transformers_loads_the_folder_and_computes_the_same(round_trip) -> None:
    _, original, _, converted = round_trip
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    logits = []
    for folder in (original, converted):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        with torch.inference_mode():
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_engine_generates_the_same_from_the_gguf(round_trip, monkeypatch: pytest.MonkeyPatch) -> None:
    """pagedllm runs the GGUF file itself: the same greedy tokens as from the original folder."""
    _, original, path, converted = round_trip
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(converted.parent.parent))  # reuse the conversion
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = [LLM(model=model, dtype="float32").generate(prompts, params, use_tqdm=False) for model in (original, path)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def test_every_family_has_a_round_trip() -> None:
    assert set(SUPPORTED_GGUF_ARCHITECTURES) - {gguf.MODEL_ARCH_NAMES[f.arch] for f in FAMILIES.values()} == {
        "mistral"  # a name transformers' GGUF table knows; llama.cpp writes Mistral models as llama
    }


# --- errors ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("errors")
    path = root / "tiny.gguf"
    write_gguf(save_tiny_family(root / "hf", FAMILIES["llama"]), path, FAMILIES["llama"])
    return path


def rewrite(source: Path, target: Path, drop_key: str | None = None, arch: str | None = None, **tensors) -> Path:
    """A copy of `source` with a metadata key dropped, another architecture, or extra tensors."""
    reader = gguf.GGUFReader(source)
    arch = arch or "llama"
    writer = gguf.GGUFWriter(str(target), arch)
    for key, value in reader.fields.items():
        if key == drop_key or key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = value.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            contents = value.contents()
            writer.add_array(key.replace("llama.", f"{arch}."), contents)
        else:
            writer.add_key_value(key.replace("llama.", f"{arch}."), value.contents(), kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(tuple(reversed(tensor.shape.tolist()))))
    for name, array in tensors.items():
        writer.add_tensor(name.replace("__", "."), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def assert_fails_cleanly(path: Path, cache: Path, *patterns: str) -> None:
    for lean in (False, True):  # the lean folder of the quantized path checks the file as much
        with pytest.raises(ValueError) as error:
            gguf_to_hf_folder(path, cache_dir=cache, lean=lean)
        message = str(error.value)
        assert str(path) in message, message
        for pattern in patterns:
            assert pattern in message, message
        assert list((cache / "gguf").iterdir()) == []  # nothing written


def test_truncated_tensor_data(llama_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llama_gguf.read_bytes()[:-1000])
    assert_fails_cleanly(cut, tmp_path / "cache", "truncated", "tensor")


def test_truncated_metadata(llama_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llama_gguf.read_bytes()[:600])
    assert_fails_cleanly(cut, tmp_path / "cache", "truncated", "metadata")


def test_unsupported_architecture_lists_the_supported_ones(llama_gguf: Path, tmp_path: Path) -> None:
    other = rewrite(llama_gguf, tmp_path / "mamba.gguf", arch="mamba")
    assert_fails_cleanly(other, tmp_path / "cache", "'mamba' is not supported", ", ".join(SUPPORTED_GGUF_ARCHITECTURES))


def test_qwen2moe_is_refused_naming_the_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers converts it, but pagedllm has no shared expert to run it with: refused before any tensor
    is read, by the converter and so by the engine."""
    path = tmp_path / "tiny-qwen2moe.gguf"
    write_gguf(save_tiny_family(tmp_path / "hf", QWEN2_MOE), path, QWEN2_MOE)
    refused = "GGUF architecture 'qwen2moe' is not supported: Qwen2-MoE's shared expert"
    assert_fails_cleanly(path, tmp_path / "cache", refused, ", ".join(SUPPORTED_GGUF_ARCHITECTURES))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "engine-cache"))
    with pytest.raises(ValueError, match=refused):
        LLM(model=path, dtype="float32")


def test_missing_metadata_key(llama_gguf: Path, tmp_path: Path) -> None:
    lacking = rewrite(llama_gguf, tmp_path / "lacking.gguf", drop_key="llama.block_count")
    assert_fails_cleanly(lacking, tmp_path / "cache", "'llama.block_count' is missing")


@pytest.mark.parametrize(
    ("extra", "patterns"),
    [
        (
            {"blk__0__ffn_gate_inp__weight": np.zeros((4, 64), np.float32)},
            ("blk.0.ffn_gate_inp.weight", "no counterpart"),
        ),
        # q biases make a llama with attention_bias, which then lacks its k, v and o biases.
        ({"blk__0__attn_q__bias": np.zeros(64, np.float32)}, ("no tensor for LlamaForCausalLM", "k_proj.bias")),
    ],
)
def test_tensors_that_do_not_fit_the_model(llama_gguf: Path, tmp_path: Path, extra, patterns) -> None:
    odd = rewrite(llama_gguf, tmp_path / "odd.gguf", **extra)
    assert_fails_cleanly(odd, tmp_path / "cache", *patterns)


# --- llama3 rope scaling from rope_freqs ----------------------------------------------------------


@pytest.mark.parametrize(
    ("theta", "dim", "factor", "low", "high", "original"),
    [
        (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 / 3.3
        (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B / 3B
        (10000.0, 64, 4.0, 2.0, 16.0, 2048),  # no Llama's: recovered from the smoothed band
    ],
)
def test_llama3_rope_parameters_are_recovered_from_rope_freqs(theta, dim, factor, low, high, original) -> None:
    factors = llama3_rope_factors(theta, dim, factor, low, high, original).astype(np.float32)
    recovered = llama3_rope_scaling(factors, theta, dim, original_context=original)
    assert recovered["rope_type"] == "llama3" and recovered["factor"] == pytest.approx(factor)
    again = llama3_rope_factors(
        theta,
        dim,
        recovered["factor"],
        recovered["low_freq_factor"],
        recovered["high_freq_factor"],
        recovered["original_max_position_embeddings"],
    )
    np.testing.assert_allclose(again, factors, rtol=1e-5)
    if original == 8192:  # Llama's own numbers come back as they were
        assert (recovered["low_freq_factor"], recovered["high_freq_factor"]) == (low, high)


def test_unscaled_and_foreign_rope_freqs() -> None:
    assert llama3_rope_scaling(np.ones(8, np.float32), 10000.0, 16) is None
    with pytest.raises(ValueError, match="does not follow Llama 3"):
        llama3_rope_scaling(np.array([1, 3, 1, 5, 2, 8, 8, 8], np.float32), 10000.0, 16)
