"""The decoder layers in one C call (`models/lean.py`) against the Python layers they stand in for: the same
kernels with the same arguments in the same order, so every step's logits are the same bit for bit (and greedy
float32 on the blocks still equals transformers: tests/test_quantized.py, tests/test_default_model.py run it); the
steps it cannot run fall back to the layers."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.models import lean as lean_module
from pagedllm.models.lean import LeanLayers
from pagedllm.models.quantized import has_integer_kernel
from pagedllm.outputs import RequestOutput
from tests.test_gguf_families import FAMILIES, save_tiny_family, write_gguf

TINY = {
    "llama-q4_1": dataclasses.replace(FAMILIES["llama"], quant={"": Q.Q4_1}),
    "mistral-q8_0": dataclasses.replace(FAMILIES["mistral"], quant={"": Q.Q8_0}),
    "qwen2-q8_0": dataclasses.replace(FAMILIES["qwen2"], f16=False, quant={"": Q.Q8_0}),  # biases on q/k/v
    # q/k/v in three parts and gate/up in two, of different types, as a Q4_K_M file mixes them (K-quants need rows
    # of 256 values, wider than these models).
    "llama-mixed": dataclasses.replace(
        FAMILIES["llama"],
        quant={"attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1, "": Q.Q4_0},
    ),
    # Not lean: a type without a kernel (Q5_0), Gemma's sandwich norms.
    "llama-q5_0": dataclasses.replace(FAMILIES["llama"], quant={"": Q.Q5_0}),
    "gemma2-q4_1": dataclasses.replace(FAMILIES["gemma2"], quant={"": Q.Q4_1}),
}
LEAN = {"llama-q4_1", "mistral-q8_0", "qwen2-q8_0", "llama-mixed"}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lean")
    files = {}
    for name, family in TINY.items():
        files[name] = root / f"{name}.gguf"
        write_gguf(with_biases(save_tiny_family(root / name, family)), files[name], family)
    return files


def with_biases(folder: Path) -> Path:
    """The folder with its biases (transformers starts them at zero) drawn at random, so that they count."""
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "lean-cache"))


@pytest.fixture
def lean_steps(monkeypatch) -> list[int]:
    """The row count of every step the C loop ran."""
    steps: list[int] = []
    run = LeanLayers.run

    def counted(self: LeanLayers, residual: torch.Tensor, rope, ctx) -> torch.Tensor:
        steps.append(residual.shape[0])
        return run(self, residual, rope, ctx)

    monkeypatch.setattr(LeanLayers, "run", counted)
    return steps


def engine(path: Path, **options) -> LLM:
    # No prefix cache and a small token budget: both runs make the same steps, prompt chunks beside decodes.
    defaults = dict(dtype="float32", num_kv_blocks=96, enable_prefix_caching=False, max_num_batched_tokens=24)
    return LLM(model=path, **(defaults | options))


def run(llm: LLM) -> list[RequestOutput]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    return llm.generate(prompts, params, use_tqdm=False)


def picks(outputs: list[RequestOutput]) -> list[tuple]:
    """Each sample's tokens and the exact log-probabilities of its top 5 at every position."""
    return [
        (sample.token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in sample.logprobs])
        for output in outputs
        for sample in output.outputs
    ]


def python_layers(llm: LLM) -> LLM:
    llm.engine.loaded.model.lean = None
    return llm


BF16_IN_ONE_CALL = pytest.mark.skipif(
    not has_integer_kernel(torch.bfloat16), reason="bf16 runs in one call where the CPU has AVX512-VNNI"
)


@pytest.mark.parametrize(
    ("name", "dtype", "kv"),
    [
        *((name, "float32", "auto") for name in sorted(LEAN)),
        ("llama-q4_1", "float32", "int8"),
        ("qwen2-q8_0", "float32", "int8"),
        pytest.param("llama-q4_1", "bfloat16", "auto", marks=BF16_IN_ONE_CALL),
        pytest.param("llama-q4_1", "bfloat16", "int8", marks=BF16_IN_ONE_CALL),
    ],
)
def test_steps_in_one_call_equal_the_python_layers(name: str, dtype: str, kv: str, tiny_files, lean_steps) -> None:
    llm = engine(tiny_files[name], dtype=dtype, kv_cache_dtype=kv)
    assert llm.engine.loaded.model.lean is not None
    lean = picks(run(llm))
    assert len(lean_steps) > 24 and max(lean_steps) > 4  # decodes, and prompt chunks beside them
    count = len(lean_steps)
    assert picks(run(python_layers(llm))) == lean
    assert len(lean_steps) == count


def test_the_default_model_runs_its_steps_in_one_call(lean_steps) -> None:
    llm = engine(None, num_kv_blocks=64)
    assert llm.engine.loaded.model.lean is not None
    lean = picks(run(llm))
    assert lean_steps
    assert picks(run(python_layers(llm))) == lean


def test_each_layers_window_reaches_the_kernel(tiny_files, lean_steps) -> None:
    """Sliding windows per layer (set on a loaded model: a llama GGUF file carries none); without them the
    answers differ, so a window lost on the way would show."""
    llm = engine(tiny_files["llama-q4_1"])
    model = llm.engine.loaded.model
    plain = picks(run(llm))
    for layer, window in zip(model.layers, (6, 0, 11, 3), strict=False):
        layer.self_attn.window = window
    model.lean = LeanLayers.of(model, torch.float32)
    windowed = picks(run(llm))
    assert windowed != plain and lean_steps
    assert picks(run(python_layers(llm))) == windowed


@pytest.mark.parametrize("name", sorted(set(TINY) - LEAN))
def test_layers_it_cannot_run_keep_the_python_loop(name: str, tiny_files) -> None:
    assert engine(tiny_files[name]).engine.loaded.model.lean is None


def test_bf16_runs_in_one_call_where_packed_weights_have_their_kernel(tiny_files) -> None:
    llm = engine(tiny_files["llama-q4_1"], dtype="bfloat16")
    assert (llm.engine.loaded.model.lean is not None) == has_integer_kernel(torch.bfloat16)


def test_steps_it_cannot_run_go_through_the_layers(tiny_files, lean_steps) -> None:
    outputs = run(engine(tiny_files["llama-q4_1"], dequantize=True))
    assert all(len(sample.token_ids) == 24 for output in outputs for sample in output.outputs)
    assert not lean_steps


def test_more_rows_than_the_blocks_take_go_through_the_layers(tiny_files, lean_steps, monkeypatch) -> None:
    monkeypatch.setattr(lean_module.quantized, "FEW_ROWS", 8)  # prompt chunks of 24 rows use the dense copies
    llm = engine(tiny_files["llama-q4_1"], int16_activations=False)
    lean = picks(run(llm))
    assert lean_steps and max(lean_steps) <= 8
    assert picks(run(python_layers(llm))) == lean


@pytest.mark.skipif(not has_integer_kernel(torch.float32), reason="float32 weights are packed where AVX2 is")
def test_packed_float32_weights_take_every_row_count_in_one_call(tiny_files, lean_steps, monkeypatch) -> None:
    monkeypatch.setattr(lean_module.quantized, "FEW_ROWS", 8)  # the blocks as stored would stop at 8
    llm = engine(tiny_files["llama-q4_1"])
    lean = picks(run(llm))
    assert max(lean_steps) == 24  # the prompt chunks too
    assert picks(run(python_layers(llm))) == lean
