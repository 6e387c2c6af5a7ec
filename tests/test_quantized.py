"""GGUF weights held quantized: the kernels against gguf's own dequantization, whole models against
`transformers` on the dequantized weights, and damaged blocks refused."""

from __future__ import annotations

import ctypes
import dataclasses
import random
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams, native
from pagedllm.config import EngineConfig
from pagedllm.models import loader, prepack, quantized
from pagedllm.models.gguf import gguf_to_hf_folder, quantized_weights
from pagedllm.models.quantized import (
    BF16_ROWS,
    FEW_ROWS,
    WIDENED_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    matmul,
)
from tests.reference import compare_greedy, reference_greedy
from tests.test_gguf_families import FAMILIES, K_SCALES, quantize_blocks, save_tiny_family, write_gguf

KINDS = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _weight(kind: Q, out_features: int, in_features: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight quantized by gguf, and its values as gguf dequantizes them (float64)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((out_features, in_features)).astype(np.float32)
    blocks = quantize_blocks(values, kind, rng)
    exact = gguf.quants.dequantize(blocks, kind).reshape(out_features, in_features)
    return QuantizedWeight(kind, torch.from_numpy(blocks), in_features), torch.from_numpy(exact).double()


@pytest.fixture(params=["native", "portable"])
def path(request, monkeypatch) -> str:
    monkeypatch.setattr(quantized, "TILE_BYTES", 2048)  # the many-row path in tiles of 16 rows
    if request.param == "portable":
        monkeypatch.setattr(quantized, "library", lambda: None)
    else:
        assert quantized.library() is not None, "this machine has a C compiler: the native path must build"
    return request.param


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 11, 20, 21, 22, 23, 37, FEW_ROWS, FEW_ROWS + 1])
def test_float32_product_is_the_dequantized_product(kind: Q, rows: int, path: str) -> None:
    """Every tile of the blocks' kernels (dot products below 20 rows, panels from 20: 6 rows, and the 1-5 left
    over) and the many-row path."""
    weight, exact = _weight(kind, 96, 512)
    x = torch.randn(rows, 512)
    out = matmul(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    expected = x.double() @ exact.T
    # float32 sums of 512 products: a few ulps of the terms' magnitude.
    bound = 1e-5 * (x.double().abs() @ exact.abs().T).max().item()
    assert (out.double() - expected).abs().max().item() < bound


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [5, 23])
def test_float32_kernel_over_long_rows_and_an_odd_row_count(kind: Q, rows: int) -> None:
    """Rows longer than one chunk of the blocks' kernels (their sums carried from chunk to chunk), and 7 weight
    rows (dot products: the last multiplied alone; panels: one panel of 16 part empty)."""
    weight, exact = _weight(kind, 7, 4608, seed=3)
    x = torch.randn(rows, 4608)
    expected = x.double() @ exact.T
    bound = 1e-5 * (x.double().abs() @ exact.abs().T).max().item()
    assert (matmul(x, weight).double() - expected).abs().max().item() < bound


def test_the_bf16_kernel_is_built_where_the_cpu_has_avx512_bf16() -> None:
    lib = quantized.library()
    assert lib is not None and bool(lib.has_bf16_gemm()) == ("avx512_bf16" in native.cpu_flags().split())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [2, WIDENED_ROWS + 5, BF16_ROWS + 3])
def test_bf16_product_is_within_bf16_rounding(kind: Q, rows: int, path: str) -> None:
    weight, exact = _weight(kind, 64, 256, seed=1)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    out = matmul(x, weight)
    assert out.dtype == torch.bfloat16
    expected = x.double() @ exact.T
    scale = (x.double().abs() @ exact.abs().T).max().item()
    # The output's rounding (2^-8 relative) and, on the many-row path, the weights' (2^-8 each).
    assert (out.double() - expected).abs().max().item() < 2**-7 * scale


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_dequantize_and_row_order(kind: Q, path: str) -> None:
    weight, exact = _weight(kind, 40, 256, seed=2)
    assert torch.equal(weight.dequantize(torch.float32).double(), exact)
    order = torch.randperm(40)
    assert torch.equal(weight.rows(order).dequantize(torch.float32).double(), exact[order])


@pytest.fixture(scope="module")
def portable_library(tmp_path_factory) -> ctypes.CDLL:
    """quant_ops.c built for any x86-64 since 2009 (SSE4.2, no AVX): the code other CPUs than this one run."""
    out = tmp_path_factory.mktemp("portable") / "quant_ops.so"
    flags = [f for f in native.FLAGS if not f.startswith("-march")]
    source = native.CSRC_DIR / "quant_ops.c"
    subprocess.run(["gcc", *flags, "-march=x86-64-v2", f"-I{native.CSRC_DIR}", str(source), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_kernels_built_without_vector_extensions(kind: Q, portable_library: ctypes.CDLL, monkeypatch) -> None:
    assert portable_library.has_bf16_gemm() == 0
    monkeypatch.setattr(quantized, "library", lambda: quantized.declare(portable_library))
    weight, exact = _weight(kind, 48, 512, seed=3)
    assert torch.equal(weight.dequantize(torch.float32).double(), exact)
    x = torch.randn(5, 512)
    bound = 1e-5 * (x.double().abs() @ exact.abs().T).max().item()
    assert (matmul(x, weight).double() - x.double() @ exact.T).abs().max().item() < bound


@pytest.mark.parametrize("high", [0x7E, 0xFC, 0x7C], ids=["nan", "-inf", "inf"])
def test_a_nan_or_inf_scale_is_refused_naming_where(high: int) -> None:
    weight, _ = _weight(Q.Q4_1, 4, 64)
    weight.check("t")  # a sound weight passes
    damaged = weight.data.clone()
    damaged[2, 20 + 2 : 20 + 4] = torch.tensor([0x00, high], dtype=torch.uint8)  # block 1's minimum, fp16
    with pytest.raises(ValueError, match="t: Q4_1 block 1 of row 2 has a scale that is NaN or inf"):
        QuantizedWeight(Q.Q4_1, damaged, 64).check("t")


# --- whole models ---------------------------------------------------------------------------------

# Each family once, as llama-quantize would write it; a second type on attn_v and ffn_down makes fused
# q/k/v and the MLP hold parts of different types, as a Q4_K_M file's layers do. Gemma's attn_k is of a type
# without a kernel: its fused q/k/v stays a plain layer, whose q and v the loader dequantizes from the blocks
# it holds (the lean folder has no copy of them).
QUANTIZED_FAMILIES = {
    "llama-q4_0": dataclasses.replace(FAMILIES["llama"], quant={"attn_v": Q.Q8_0, "": Q.Q4_0}),
    "qwen2-q8_0": dataclasses.replace(FAMILIES["qwen2"], f16=False, quant={"": Q.Q8_0}),
    "gemma2-q4_1": dataclasses.replace(FAMILIES["gemma2"], quant={"ffn_down": Q.Q8_0, "attn_k": Q.Q5_0, "": Q.Q4_1}),
    "phi3-q4_0": dataclasses.replace(FAMILIES["phi3"], quant={"": Q.Q4_0}),
}


@pytest.fixture(scope="module", params=sorted(QUANTIZED_FAMILIES))
def quantized_file(request, tmp_path_factory) -> tuple[Path, Path]:
    family = QUANTIZED_FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    path = root / f"tiny-{request.param}.gguf"
    write_gguf(save_tiny_family(root / "hf", family), path, family)
    return path, gguf_to_hf_folder(path, cache_dir=root / "cache")


def _plain_qkv(path: Path) -> bool:
    return any(
        not quantized.holds_quantized(kind)
        for kind in QUANTIZED_FAMILIES[path.stem.removeprefix("tiny-")].quant.values()
    )


def test_greedy_float32_on_quantized_weights_equals_transformers(quantized_file, monkeypatch) -> None:
    """The oracle: `transformers` on the GGUF's weights dequantized to float32 (the converted folder)."""
    path, folder = quantized_file
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(folder.parent.parent))
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, dequantize=False)
    model = llm.engine.loaded.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    per_layer = 3 if _plain_qkv(path) else 4  # qkv, o, gate_up, down; the LM head
    assert len(linears) == per_layer * len(model.layers) + 1
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 9, 40)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    comparison = compare_greedy(outputs, reference_greedy(folder, prompts, 12))
    assert comparison.exact == len(prompts), comparison


def test_the_quantized_path_reads_a_folder_without_the_quantized_tensors(quantized_file, monkeypatch) -> None:
    path, folder = quantized_file
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(folder.parent.parent))
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, dequantize=False)
    lean = llm.engine.loaded.folder
    assert lean != folder
    held = set(quantized_weights(path, lean))
    whole, kept = load_file(folder / "model.safetensors"), load_file(lean / "model.safetensors")
    assert held and held <= set(whole) and not held & set(kept)
    assert set(kept) == set(whole) - held  # everything else, as the whole folder has it
    assert all(torch.equal(kept[name], whole[name]) for name in kept)


def test_dequantize_keeps_the_plain_layers(quantized_file, monkeypatch) -> None:
    path, folder = quantized_file
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(folder.parent.parent))
    model = LLM(model=path, dtype="float32", num_kv_blocks=64, dequantize=True).engine.loaded.model
    assert not any(isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in model.modules())


@pytest.fixture
def llama_q4_1(tmp_path, monkeypatch) -> Path:
    spec = dataclasses.replace(FAMILIES["llama"], quant={"": Q.Q4_1})
    path = tmp_path / "tiny.gguf"
    write_gguf(save_tiny_family(tmp_path / "hf", spec), path, spec)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return path


def _layers(llm: LLM) -> list[QuantizedLinear]:
    return [m for m in llm.engine.loaded.model.modules() if isinstance(m, QuantizedLinear)]


def test_float32_layers_on_float_activations_hold_a_dense_copy_beside_their_blocks(
    llama_q4_1: Path, monkeypatch
) -> None:
    """Without the integer kernel, each float32 layer keeps its blocks (up to FEW_ROWS rows) and a dequantized,
    prepacked copy (more rows), and a run that uses both gives transformers' greedy tokens on the dequantized
    weights; bf16 layers get a copy only where AVX512-VNNI is missing; asking either way is obeyed."""
    monkeypatch.setattr(quantized, "FEW_ROWS", 8)  # so that this short run's prefill reaches the copy
    llm = LLM(model=llama_q4_1, dtype="float32", num_kv_blocks=64, int16_activations=False)
    layers = _layers(llm)
    assert layers and all(layer.dense is not None for layer in layers)
    assert isinstance(llm.engine.loaded.model.embed_tokens, QuantizedEmbedding)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 40)]  # prefill: dense; decode: 3 rows
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    folder = gguf_to_hf_folder(llama_q4_1)
    comparison = compare_greedy(outputs, reference_greedy(folder, prompts, 10))
    assert comparison.exact == len(prompts), comparison
    no_copy = LLM(model=llama_q4_1, dtype="float32", dequantize=False, int16_activations=False)
    assert all(layer.dense is None for layer in _layers(no_copy))
    assert not _layers(LLM(model=llama_q4_1, dtype="float32", dequantize=True))
    assert loader.holds_dense(llama_q4_1, torch.bfloat16, "cpu", 1, None) == (
        not HAS_VNNI and prepack.can_prepack(torch.empty(0, dtype=torch.bfloat16))
    )


def test_a_layer_with_a_dense_copy_multiplies_few_rows_from_its_blocks(monkeypatch) -> None:
    weight, _ = _weight(Q.Q4_1, 64, 128)
    layer = QuantizedLinear([weight], bias=False)
    layer.hold_dense(torch.float32)
    calls = []
    monkeypatch.setattr(quantized, "matmul", lambda x, part: calls.append(x.shape[0]) or torch.zeros(x.shape[0], 64))
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, FEW_ROWS + 17):
        layer(torch.randn(rows, 128))
    assert calls == [1, FEW_ROWS]
    monkeypatch.undo()
    x = torch.randn(FEW_ROWS + 17, 128)
    torch.testing.assert_close(layer(x), x @ weight.dequantize(torch.float32).T, rtol=1e-5, atol=1e-5)


def test_no_dense_copy_where_it_would_not_fit(llama_q4_1: Path, monkeypatch, caplog) -> None:
    elements = sum(t.n_elements for t in gguf.GGUFReader(llama_q4_1).tensors)
    monkeypatch.setattr(loader, "available_memory", lambda: int(elements * 4 / loader.DEQUANTIZED_SHARE) - 1)
    options = dict(model=llama_q4_1, dtype="float32", int16_activations=False)
    with caplog.at_level("WARNING", logger="pagedllm.models.loader"):
        assert all(layer.dense is None for layer in _layers(LLM(**options)))
    assert "quantized blocks alone" in caplog.text and "dequantize=True" in caplog.text
    monkeypatch.setattr(loader, "available_memory", lambda: int(elements * 4 / loader.DEQUANTIZED_SHARE) + 4)
    assert all(layer.dense is not None for layer in _layers(LLM(**options)))


# --- quantization= on an HF checkpoint --------------------------------------------------------------

TYPES = {"int8": Q.Q8_0, "int4": Q.Q4_0}


def _round_tripped(original: Path, target: Path, kind: Q) -> Path:
    """`original` with every matrix quantized to `kind` by gguf and dequantized again: what the engine computes
    with, as a checkpoint transformers reads."""
    shutil.copytree(original, target)
    tensors = load_file(original / "model.safetensors")
    for name, tensor in tensors.items():
        if tensor.ndim == 2:
            values = tensor.float().numpy()
            back = gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind).reshape(values.shape)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(back)).to(tensor.dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("quantization", sorted(TYPES))
def test_quantization_equals_transformers_on_the_round_tripped_weights(quantization, tiny_llama, tmp_path) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, quantization=quantization)
    model = llm.engine.loaded.model
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.parts[0].kind == TYPES[quantization]
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (2, 11, 35)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    reference = _round_tripped(tiny_llama, tmp_path / "round-tripped", TYPES[quantization])
    comparison = compare_greedy(outputs, reference_greedy(reference, prompts, 12))
    assert comparison.exact == len(prompts), comparison


def test_quantization_is_refused_off_a_single_cpu_rank() -> None:
    with pytest.raises(ValueError, match="quantization 'int8' runs on one CPU rank only"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")


# --- Q4_0 and Q4_1 repacked for the integer kernel (AVX512-VNNI) -------------------------------------

PACKED_KINDS = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
HAS_VNNI = {"avx512_vnni", "avx512_bf16"} <= set(native.cpu_flags().split())
FLOAT32_PACKED_KINDS = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
HAS_X16 = {"avx2", "fma"} <= set(native.cpu_flags().split())


def test_the_integer_kernel_is_built_where_the_cpu_has_avx512_vnni() -> None:
    lib = quantized.library()
    assert lib is not None and bool(lib.has_vnni_gemm()) == HAS_VNNI


@pytest.mark.parametrize("kind", sorted(set(PACKED_KINDS) | set(FLOAT32_PACKED_KINDS)), ids=lambda k: k.name)
def test_packing_moves_the_bytes_in_place_and_unpacks_to_them(kind: Q) -> None:
    weight, exact = _weight(kind, 48, 512, seed=4)
    raw = weight.data.clone()
    packed = quantized.pack(weight)
    assert packed.data.data_ptr() == weight.data.data_ptr()  # no second copy of the model
    assert not torch.equal(packed.data, raw) and torch.equal(packed.data.flatten().sort()[0], raw.flatten().sort()[0])
    assert torch.equal(packed.unpacked(0, 48).data, raw)
    assert torch.equal(packed.unpacked(16, 48).data, raw[16:48])
    index = torch.tensor([47, 3, 3, 20, 0])
    assert torch.equal(packed.rows(index).data, raw[index])  # a tied embedding's lookups
    x = torch.randn(20, 512)  # float32 activations: the dequantized tiles, float32 sums
    bound = 1e-5 * (x.double().abs() @ exact.abs().T).max().item()
    assert (matmul(x, packed).double() - x.double() @ exact.T).abs().max().item() < bound


def _packed_product(
    kind: Q, rows: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight packed for `dtype`'s integer kernel times random rows: the output, the exact product, the
    bound of the activations' int16 quantization (each off by at most half its block's step, amax / 32767: int8
    steps are 258 times coarser) and the product of the magnitudes, all float64."""
    weight, exact = _weight(kind, out_features, in_features, seed=seed)
    assert quantized.packs(weight, dtype)
    packed = quantized.pack(weight)
    x = torch.randn(rows, in_features).to(dtype)
    x[0, 40] = 30.0  # an outlier sets its block's scale: the others keep 15 bits
    out = matmul(x, packed)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    step = x.double().abs().reshape(rows, -1, 32).amax(-1) / 32767
    quantization = (step / 2) @ exact.abs().reshape(out_features, -1, 32).sum(-1).T
    return out.double(), x.double() @ exact.T, quantization, x.double().abs() @ exact.abs().T


@pytest.mark.skipif(not HAS_VNNI, reason="no AVX512-VNNI here: weights are never packed, the kernel is not built")
@pytest.mark.parametrize("kind", PACKED_KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 37])
def test_the_integer_product_is_within_the_outputs_bf16_rounding(kind: Q, rows: int) -> None:
    out, expected, quantization, _ = _packed_product(kind, rows, 512, 64, torch.bfloat16, seed=5)
    # Then the output's bf16 rounding, up to 2^-8 of it.
    bound = 1.01 * quantization + 2**-8 * (expected.abs() + quantization) + 1e-6
    assert ((out - expected).abs() <= bound).all()


def test_the_float32_integer_kernel_is_built_where_the_cpu_has_avx2() -> None:
    lib = quantized.library()
    assert lib is not None and bool(lib.has_x16_gemm()) == HAS_X16


@pytest.mark.skipif(not HAS_X16, reason="no AVX2 here: float32 weights are never packed, the kernel is not built")
@pytest.mark.parametrize("kind", FLOAT32_PACKED_KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 37, 70])
def test_the_float32_integer_product_is_within_the_activations_quantization(kind: Q, rows: int) -> None:
    """Up to 3 rows in register tiles, from 4 through panels (70: two chunks of 64 rows, tiles of 3 with 1 and 2
    left over); 288 inputs, 9 blocks: a panel of 8 and one of 1; a K-quant's 768 inputs, 3 super-blocks: a panel
    each."""
    in_features = 768 if kind in K_SCALES else 288
    out, expected, quantization, magnitude = _packed_product(kind, rows, in_features, 48, torch.float32, seed=6)
    # Then float32 sums and scales.
    assert ((out - expected).abs() <= 1.01 * quantization + 1e-5 * magnitude).all()
    assert (out - expected).abs().max() > 0  # quantized: not the float product


@pytest.mark.skipif(not HAS_X16, reason="no AVX2 here: float32 weights are never packed")
def test_a_float32_model_holds_its_matrices_packed_without_dense_copies(llama_q4_1: Path) -> None:
    """Every layer and the tied head packed, none with a dequantized copy, and transformers' greedy tokens on
    the dequantized weights (wide random weights: few near-ties for the int16 activations to tip)."""
    llm = LLM(model=llama_q4_1, dtype="float32", num_kv_blocks=64)
    layers = _layers(llm)
    assert layers and all(layer.dense is None for layer in layers)
    assert all(isinstance(part, quantized.PackedWeight) for layer in layers for part in layer.parts)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 40)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    comparison = compare_greedy(outputs, reference_greedy(gguf_to_hf_folder(llama_q4_1), prompts, 10))
    assert comparison.exact == len(prompts), comparison


@pytest.mark.skipif(not HAS_X16, reason="no AVX2 here: float32 weights are never packed")
def test_a_float32_k_quant_model_holds_its_matrices_packed_without_dense_copies(tmp_path, monkeypatch) -> None:
    """A Q4_K_M file's mix (Q4_K, Q6_K on attn_v and ffn_down) and Q5_K on ffn_up (gate/up fused of two types) in
    rows of 256 values: every layer packed, none with a dequantized copy, and transformers' greedy tokens on the
    dequantized weights."""
    llama = FAMILIES["llama"]
    settings = {**llama.settings, "hidden_size": 256, "intermediate_size": 512}
    quant = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "ffn_up": Q.Q5_K, "": Q.Q4_K}
    spec = dataclasses.replace(llama, settings=settings, quant=quant)
    path = tmp_path / "tiny.gguf"
    write_gguf(save_tiny_family(tmp_path / "hf", spec), path, spec)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    layers = [layer for layer in _layers(llm) if layer is not llm.engine.loaded.model.lm_head]
    assert layers and all(layer.dense is None for layer in layers)
    kinds = {(type(part).__name__, part.kind) for layer in layers for part in layer.parts}
    assert kinds == {("PackedWeight", kind) for kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K)}
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (2, 9, 40)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    comparison = compare_greedy(outputs, reference_greedy(gguf_to_hf_folder(path), prompts, 10))
    assert comparison.exact == len(prompts), comparison


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_bf16_model_holds_its_matrices_packed(family: str, monkeypatch, tmp_path) -> None:
    """Mistral's LM head is tied: packed once, and the embedding looks its rows up in the packed weight."""
    spec = dataclasses.replace(FAMILIES[family], quant={"attn_v": Q.Q8_0, "ffn_down": Q.Q4_1, "": Q.Q4_0})
    path = tmp_path / "tiny.gguf"
    write_gguf(save_tiny_family(tmp_path / "hf", spec), path, spec)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    packed = "PackedWeight" if HAS_VNNI else "QuantizedWeight"
    llm = LLM(model=path, dtype="bfloat16", num_kv_blocks=64, dequantize=False)
    model = llm.engine.loaded.model

    def parts(name: str) -> set[str]:
        return {type(part).__name__ for part in model.get_submodule(name).parts}

    assert parts("layers.0.mlp.gate_up_proj") == parts("layers.0.mlp.down_proj") == parts("lm_head") == {packed}
    assert parts("layers.0.self_attn.qkv_proj") == {packed, "QuantizedWeight"}  # v is Q8_0
    if family == "mistral":
        assert model.embed_tokens.table is model.lm_head.parts[0]
    # the same greedy tokens as the float32 model on the same file (wide random weights: few near-ties)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    bf16 = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    float32 = LLM(model=path, dtype="float32", num_kv_blocks=64, dequantize=False, int16_activations=False)
    assert {type(p).__name__ for p in float32.engine.loaded.model.lm_head.parts} == {"QuantizedWeight"}
    assert bf16 == [o.outputs[0].token_ids for o in float32.generate(prompts, params, use_tqdm=False)]
